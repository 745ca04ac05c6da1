"""Routing with two real engine processes behind a real gateway: headroom wins, prefixes stick, and the
comparison strategies do what they say."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest

from tests.conftest import start_engine_servers, start_gateway, stop_process
from tests.support.engines import hold_stream, waiting
from tests.support.gateways import wait_until_routable


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    # Engine A takes one sequence at a time, so a few long requests sent to it directly pile up in its queue.
    (a, url_a), (b, url_b) = start_engine_servers(
        tiny_model_dir, ("--max-num-seqs", "1", "--max-model-len", "1024", "--kv-cache-memory", "32MiB"),
        ("--max-model-len", "1024", "--kv-cache-memory", "32MiB"))
    yield url_a, url_b
    stop_process(a)
    stop_process(b)


@pytest.fixture(scope="module")
def model(engines) -> str:
    return httpx.get(f"{engines[0]}/v1/models").json()["data"][0]["id"]


def gateway_for(engines, *extra: str):
    proc, url = start_gateway(*(arg for e in engines for arg in ("--engine", e)), *extra)
    wait_until_routable(url, len(engines))
    return proc, url


def complete(url: str, model: str, prompt: str = "hi", max_tokens: int = 4, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                      "ignore_eos": True}, headers=headers, timeout=120)


def test_requests_go_to_the_engine_with_headroom(engines, model: str) -> None:
    url_a, url_b = engines
    proc, gateway = gateway_for(engines)
    stop = threading.Event()
    backlog = [threading.Thread(target=hold_stream, args=(url_a, model, stop)) for _ in range(7)]
    try:
        for t in backlog:
            t.start()
        deadline = time.monotonic() + 30
        while waiting(url_a) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waiting(url_a) >= 5  # engine A is saturated (queue >= 5); B is idle
        while httpx.get(f"{gateway}/ready").json()["available"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # until the gateway has scraped it so
        served = Counter(complete(gateway, model).headers["x-kvfleet-engine"] for _ in range(8))
        assert served == {url_b: 8}
    finally:
        stop.set()
        stop_process(proc)
        for t in backlog:
            t.join()


def test_requests_sharing_a_prompt_prefix_go_to_the_same_engine(engines, model: str) -> None:
    proc, gateway = gateway_for(engines)
    system = "You are a meticulous assistant who answers in one short sentence. " * 8
    try:
        served = [complete(gateway, model, system + f"Question {i}: what is {i} + {i}?").headers["x-kvfleet-engine"]
                  for i in range(6)]
        assert len(set(served)) == 1, served
        other = [complete(gateway, model, f"{i} unrelated prompt that shares nothing " * 8)
                 .headers["x-kvfleet-engine"] for i in range(10)]
        assert len(set(other)) == 2  # without a shared prefix, the load spreads over both engines
    finally:
        stop_process(proc)


def test_round_robin_alternates_blind_to_load(engines, model: str) -> None:
    proc, gateway = gateway_for(engines, "--routing", "round-robin")
    try:
        served = [complete(gateway, model).headers["x-kvfleet-engine"] for _ in range(6)]
        assert served[0::2] == [served[0]] * 3 and served[1::2] == [served[1]] * 3 and served[0] != served[1]
    finally:
        stop_process(proc)
