"""API keys and per-key limits through a real gateway process (a real engine behind it, a real Redis).
Bad inputs tried: no key, a wrong key, a key in the wrong header scheme; over rpm, over tpm."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from kvfleet.fleet.headers import combined
from kvfleet.gateway.proxy import upstream_headers
from tests.conftest import start_gateway, stop_process
from tests.support.gateways import wait_until_routable

HASHED_KEY = "sk-hashed-only-" + "z" * 20


@pytest.fixture(scope="module")
def gateway(tiny_server: str, redis_server_module, tmp_path_factory) -> str:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# team keys\n"
                    "sk-limited-aaaaaaaaaaaa name=limited rpm=2\n"
                    f"sha256:{hashlib.sha256(HASHED_KEY.encode()).hexdigest()} name=hashed\n"
                    "sk-tokens-bbbbbbbbbbbb name=tokens tpm=4\n")
    proc, url = start_gateway("--engine", tiny_server, "--redis-url", redis_server_module.url, "--fleet", "keys",
                              "--api-keys-file", str(keys))
    wait_until_routable(url)
    yield url
    stop_process(proc)


@pytest.fixture(scope="module")
def model(tiny_server: str) -> str:
    return httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]


def call(gateway: str, model: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4,
                                                         "ignore_eos": True}, headers=headers, timeout=30)


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-wrong"}, {"authorization": HASHED_KEY},
                                     {"x-api-key": "sk-wrong"}])
def test_requests_without_a_valid_key_get_401(gateway: str, model: str, headers: dict) -> None:
    r = call(gateway, model, **headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.json()["error"]["message"]


def test_a_key_stored_only_as_its_hash_works_in_either_header(gateway: str, model: str) -> None:
    assert call(gateway, model, authorization=f"Bearer {HASHED_KEY}").status_code == 200
    assert call(gateway, model, **{"x-api-key": HASHED_KEY}).status_code == 200
    assert httpx.get(f"{gateway}/v1/models", headers={"authorization": f"Bearer {HASHED_KEY}"}).status_code == 200
    assert httpx.get(f"{gateway}/v1/models").status_code == 401


def test_a_key_over_its_requests_per_minute_gets_429_with_retry_after(gateway: str, model: str) -> None:
    auth = {"authorization": "Bearer sk-limited-aaaaaaaaaaaa"}
    assert [call(gateway, model, **auth).status_code for _ in range(2)] == [200, 200]
    r = call(gateway, model, **auth)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rpm_limit"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert call(gateway, model, authorization=f"Bearer {HASHED_KEY}").status_code == 200  # others unaffected


def test_a_key_over_its_tokens_per_minute_gets_429(gateway: str, model: str) -> None:
    auth = {"authorization": "Bearer sk-tokens-bbbbbbbbbbbb"}
    first = call(gateway, model, **auth)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 4
    deadline = time.monotonic() + 5
    while (r := call(gateway, model, **auth)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)  # the tokens are counted just after the response
    assert r.status_code == 429 and r.json()["error"]["code"] == "tpm_limit"


def test_only_the_headers_an_engine_needs_go_upstream() -> None:
    sent = upstream_headers({"content-type": "application/json", "authorization": "Bearer sk-secret",
                             "cookie": "session=1", "x-api-key": "k", "connection": "keep-alive",
                             "x-kvfleet-priority": "critical", "traceparent": "00-abc-def-01"}, "req-1")
    assert sent == {"content-type": "application/json", "traceparent": "00-abc-def-01", "x-request-id": "req-1"}


def test_a_field_sent_on_several_lines_is_read_and_sent_as_one() -> None:
    """One view for the checks and the engine (RFC 9110 5.3): lines joined in the order sent, names in lower case."""
    fields = combined([(b"Accept", b"text/event-stream"), (b"content-type", b"application/json"),
                       (b"accept", b"application/json"), ("TraceState", "a=1")])
    assert fields == {"accept": "text/event-stream, application/json", "content-type": "application/json",
                      "tracestate": "a=1"}
    assert upstream_headers(fields, "req-2")["accept"] == "text/event-stream, application/json"
