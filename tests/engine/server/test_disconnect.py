"""A client that goes away stops the engine's work on its request, streaming or not: the KV is freed at once."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_engine_server, stop_process


@pytest.fixture(scope="module")
def slow_engine(tiny_model_dir: Path):
    """A real engine with a context long enough that a request would run for many seconds."""
    proc, url = start_engine_server(tiny_model_dir, "--max-model-len", "4096")
    yield url
    stop_process(proc)


def gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_running(url: str, want: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while True:
        running = gauge(url, "kvfleet_num_requests_running") + gauge(url, "kvfleet_num_requests_waiting")
        if running == want or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def leave_after(url: str, body: dict, seconds: float) -> None:
    """Send a request and close the connection after `seconds`, as a client that gives up does."""
    try:
        with httpx.Client(timeout=httpx.Timeout(10, read=seconds)) as client:
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                started = time.monotonic()
                for _ in response.iter_raw():
                    if time.monotonic() - started > seconds:
                        return
    except httpx.ReadTimeout:  # a non-streaming answer sends nothing until it is done
        return
    raise AssertionError("the request finished before the client left; make it longer")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(slow_engine: str, stream: bool) -> None:
    max_tokens = 4000
    before = gauge(slow_engine, "kvfleet_generation_tokens_total")
    leave_after(slow_engine, {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                              "stream": stream}, 0.5)
    assert wait_running(slow_engine, 0, timeout=2.0) == 0, "the engine kept working for a client that left"
    generated = gauge(slow_engine, "kvfleet_generation_tokens_total") - before
    time.sleep(0.5)
    assert gauge(slow_engine, "kvfleet_generation_tokens_total") - before == generated
    assert generated < max_tokens, "the request ran to completion"
    done = httpx.post(f"{slow_engine}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
