"""Failures behind the gateway: an engine dying mid-stream or between requests, and Redis going away and back.
Real engine processes, real gateways and a real Redis server; failures are real kills."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import process_output, start_engine_servers, start_gateway, stop_process
from tests.test_gateway_proxy import wait_until_routable


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event(tiny_model_dir) -> None:
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ("--max-model-len", "1024",
                                                                   "--kv-cache-memory", "32MiB"))
    gateway, url = start_gateway("--engine", engine_url)
    try:
        wait_until_routable(url)
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="tell a long story", max_tokens=900, stream=True,
                                           extra_body={"ignore_eos": True})
        received = 0
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in stream:
                received += 1
                if received == 3:
                    engine.send_signal(signal.SIGKILL)
        assert received >= 3 and time.monotonic() - started < 20  # an error, not a hang
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvfleet_gateway_requests_total{code="200",priority="standard"} 1.0' in metrics
    finally:
        stop_process(gateway)
        stop_process(engine)


def test_requests_to_a_dead_engine_are_retried_elsewhere_and_the_engine_is_ejected(tiny_model_dir) -> None:
    (a, url_a), (b, url_b) = start_engine_servers(tiny_model_dir, (), ())
    # Round-robin ignores load, and a long scrape interval (with metrics allowed to age as long) keeps the dead
    # engine looking healthy, so requests really are sent to it and must be retried: the gateway learns of the
    # death only from the failures.
    gateway, url = start_gateway("--engine", url_a, "--engine", url_b, "--routing", "round-robin",
                                 "--scrape-interval-ms", "10000", "--max-metrics-age-ms", "60000",
                                 "--eject-after-failures", "2")
    try:
        wait_until_routable(url, 2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        a.send_signal(signal.SIGKILL)
        a.wait()
        served = []
        for i in range(8):
            r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": f"q{i}", "max_tokens": 3},
                           timeout=30)
            assert r.status_code == 200, r.text
            served.append(r.headers["x-kvfleet-engine"])
        assert served == [url_b] * 8
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvfleet_gateway_ejections_total{{endpoint="{url_a}"}} 1.0' in metrics
        retried = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("kvfleet_gateway_retries_total"))
        assert retried == 2  # two failures, then A is ejected and no longer tried
    finally:
        stop_process(gateway)
        stop_process(a)
        stop_process(b)


def test_redis_killed_and_restarted_the_gateway_keeps_serving_and_goes_back(tiny_model_dir, redis_server) -> None:
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ())
    gateway, url = start_gateway("--engine", engine_url, "--redis-url", redis_server.url, "--fleet", "r")
    body = {"prompt": "hello", "max_tokens": 3}
    try:
        wait_until_routable(url)
        body["model"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        assert httpx.get(f"{url}/ready").json()["queue"] == "redis"
        redis_server.proc.send_signal(signal.SIGKILL)
        redis_server.proc.wait()
        for _ in range(5):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/ready").json()["queue"] != "local" and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 200 and ready.json()["queue"] == "local"
        assert "Redis unreachable" in ready.json()["redis"]
        assert "kvfleet_gateway_redis_up 0.0" in httpx.get(f"{url}/metrics").text
        redis_server.start()  # the same port, empty
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/ready").json()["queue"] != "redis" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/ready").json()["queue"] == "redis"
        assert "kvfleet_gateway_redis_up 1.0" in httpx.get(f"{url}/metrics").text
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        stop_process(gateway)
        print(process_output(gateway))  # shown when the test fails
        stop_process(engine)
