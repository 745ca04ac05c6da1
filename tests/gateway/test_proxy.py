"""The gateway in front of a real engine process, through the official `openai` client and plain HTTP.

Bad inputs tried here: an unknown x-kvfleet-priority, x-kvfleet-max-queue-ms of 'soon', -5 and 10^9, a body that
is not JSON, a JSON array body, a body over --max-body-bytes, an unknown route, and a request the engine itself
rejects (max_tokens -1: its 400 passes through). Each gets its status and a message that says what to change.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import start_gateway, stop_process
from tests.support.gateways import until_metric, wait_until_routable


@pytest.fixture(scope="module")
def gateway(tiny_server: str, redis_server_module) -> str:
    proc, url = start_gateway("--engine", tiny_server, "--redis-url", redis_server_module.url, "--fleet", "proxy",
                              "--max-body-bytes", "20000")
    wait_until_routable(url)
    yield url
    stop_process(proc)


@pytest.fixture(scope="module")
def client(gateway: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_through_the_gateway_equals_the_engine_called_directly(client: OpenAI, model: str,
                                                                    tiny_server: str) -> None:
    args = dict(model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
                temperature=0, extra_body={"ignore_eos": True})
    raw = client.chat.completions.with_raw_response.create(**args)
    via_gateway = raw.parse()
    direct = OpenAI(base_url=f"{tiny_server}/v1", api_key="x", max_retries=0).chat.completions.create(**args)
    assert via_gateway.choices[0].message.content == direct.choices[0].message.content
    assert via_gateway.usage.completion_tokens == 12
    assert raw.headers["x-kvfleet-engine"] == tiny_server


def test_streams_pass_through_chunk_by_chunk(client: OpenAI, model: str) -> None:
    args = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert len(chunks) >= 10  # one event per token arrived, not one buffered blob
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens == 10


def test_request_id_is_kept_or_made_and_the_engine_is_named(gateway: str, model: str, tiny_server: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    given = httpx.post(f"{gateway}/v1/completions", json=body, headers={"x-request-id": "trace-123"}, timeout=30)
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-123"
    made = httpx.post(f"{gateway}/v1/completions", json=body, timeout=30)
    assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
    assert made.headers["x-kvfleet-engine"] == tiny_server


def test_streamed_response_carries_the_engine_header(gateway: str, model: str, tiny_server: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=30) as r:
        text = r.read().decode()
        assert r.status_code == 200 and r.headers["x-kvfleet-engine"] == tiny_server
        assert r.headers["content-type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("headers,param,fragment", [
    ({"x-kvfleet-priority": "urgent"}, "x-kvfleet-priority", "critical, standard, sheddable"),
    ({"x-kvfleet-max-queue-ms": "soon"}, "x-kvfleet-max-queue-ms", "from 0 to 600000"),
    ({"x-kvfleet-max-queue-ms": "-5"}, "x-kvfleet-max-queue-ms", "from 0 to 600000"),
    ({"x-kvfleet-max-queue-ms": "1000000000"}, "x-kvfleet-max-queue-ms", "from 0 to 600000"),
])
def test_bad_gateway_headers_get_400_naming_the_header(gateway: str, model: str, headers: dict, param: str,
                                                       fragment: str) -> None:
    r = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                   headers=headers, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("content,fragment", [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object")])
def test_bodies_that_are_not_json_objects_get_400(gateway: str, content: bytes, fragment: str) -> None:
    r = httpx.post(f"{gateway}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_a_body_over_the_limit_gets_413(gateway: str, model: str) -> None:
    r = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "x" * 30_000}, timeout=30)
    assert r.status_code == 413 and "20000 bytes" in r.json()["error"]["message"]


def test_unknown_routes_get_404(gateway: str) -> None:
    r = httpx.post(f"{gateway}/v1/embeddings", json={}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_the_engines_own_400_passes_through(client: OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="hi", max_tokens=-1)


def test_ready_and_metrics_describe_the_fleet(gateway: str, model: str) -> None:
    ready = httpx.get(f"{gateway}/ready").json()
    assert ready["engines"] == 1 and ready["healthy"] == 1 and ready["queue"] == "redis" and "redis" not in ready
    httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
               headers={"x-kvfleet-priority": "critical"}, timeout=30)
    text = until_metric(gateway, 'kvfleet_gateway_requests_total{code="200",priority="critical"}')
    assert "kvfleet_gateway_redis_up 1.0" in text
    assert 'kvfleet_gateway_endpoints{state="available"} 1.0' in text
    assert "kvfleet_gateway_scrape_age_seconds{endpoint=" in text


def test_a_relayed_stream_ends_once_even_when_the_client_left_before_it_started() -> None:
    """The engine's connection, its in-flight count and the request's settlement (its tokens, its tenant's slot)
    are closed however the response ends: also when sending the headers fails, so the stream never starts."""
    import asyncio

    from starlette.requests import ClientDisconnect

    from kvfleet.gateway.proxy import RelayedStream

    async def scenario() -> tuple[int, int]:
        ends, started = [], []

        async def body():
            started.append(1)
            yield b"data: x\n\n"

        async def end() -> None:
            ends.append(1)

        async def receive() -> dict:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async def gone(message: dict) -> None:
            raise OSError("the client went away")

        with pytest.raises(ClientDisconnect):  # what Starlette makes of a send that fails
            await RelayedStream(body(), end)({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, gone)
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)
        await RelayedStream(body(), end)({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        return len(ends), len(started)
    assert asyncio.run(scenario()) == (2, 1)  # ended both times; the first never started
