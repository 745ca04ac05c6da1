"""Malformed requests over raw HTTP get OpenAI-shaped 4xx errors, never a 5xx."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(tiny_server: str):
    with httpx.Client(base_url=tiny_server, timeout=30) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, text: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text in error["message"]


def test_health_and_ready(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready"}


@pytest.mark.parametrize(
    ("content", "status", "text"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"\xff\xfe{}", 400, "not valid JSON"),
        (b"[]", 400, "body"),
        (b'{"prompt": 5}', 400, "prompt"),
        (b'{"prompt": "hi", "max_tokens": 1.5}', 400, "max_tokens"),
        (b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
        (b'{"prompt": "hi", "stream": "yes please"}', 400, "stream"),
        (b'{"max_tokens": 3}', 400, "prompt"),
    ],
)
def test_malformed_completion_bodies(http: httpx.Client, content: bytes, status: int, text: str) -> None:
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, status, text)


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "only text content parts"),
    ],
)
def test_malformed_chat_bodies(http: httpx.Client, body: dict, text: str) -> None:
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, text)


def test_unknown_route_is_an_openai_shaped_404(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing-here"), 404, "no route GET /v1/nothing-here")


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "future_field": {"x": 1}})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_body_over_the_limit_is_a_413(http: httpx.Client) -> None:
    huge = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    assert_openai_error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}),
                        413, "request body is over")


def test_chunked_body_over_the_limit_is_a_413(http: httpx.Client) -> None:
    def chunks():
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    assert_openai_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                        413, "request body is over")
