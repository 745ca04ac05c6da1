"""Saturation, the fleet queue and shedding, end to end: one real engine that runs one sequence at a time, two
real gateway replicas sharing one real Redis, and clients over HTTP. The engine is held saturated by long
requests sent to it directly (one running, the rest waiting: the gateways' --saturation-queue is 1)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from kvfleet.fleet.redis_keys import queue_key
from tests.conftest import one_sequence_engine_fixtures, start_gateway, stop_process
from tests.support.clients import LeavingClient, send
from tests.support.engines import saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

FLEET = "queueing"


engine, model = one_sequence_engine_fixtures()


@pytest.fixture(scope="module")
def gateways(engine: str, redis_server_module):
    started = [start_gateway("--engine", engine, "--redis-url", redis_server_module.url, "--fleet", FLEET,
                             "--saturation-queue", "1", "--queue-caps", "standard=4",
                             # the fleet queue's order is what these tests check: critical requests queue too
                             "--no-critical-first") for _ in range(2)]
    for _, url in started:
        wait_until_routable(url)
    yield [url for _, url in started]
    for proc, _ in started:
        stop_process(proc)


@pytest.fixture(scope="module")
def queued(redis_server_module):
    client = redis.Redis.from_url(redis_server_module.url)
    return lambda: client.zcard(queue_key(FLEET))  # the documented key the operator reads


def test_critical_before_standard_across_replicas_sheddable_shed_nobody_lost(engine, model, gateways,
                                                                             queued) -> None:
    a, b = gateways
    results: dict = {}
    plan = [("s1", a, "standard"), ("s2", b, "standard"), ("c1", b, "critical"), ("c2", a, "critical")]
    threads = []
    with saturated(engine, model, (a, b)):
        for name, gw, priority in plan:
            threads.append(threading.Thread(target=send, args=(gw, model, priority, results, name)))
            threads[-1].start()
            time.sleep(0.05)
        until(lambda: queued() == 4, "the four requests never all sat in the fleet queue")
        shed = httpx.post(f"{a}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2},
                          headers={"x-kvfleet-priority": "sheddable"}, timeout=30)
        assert shed.status_code == 429 and int(shed.headers["retry-after"]) >= 1
        assert shed.json()["error"]["code"] == "shed_saturated"
        depth = httpx.get(f"{b}/metrics").text
        assert 'kvfleet_gateway_queue_depth{priority="standard"} 2.0' in depth
    for t in threads:
        t.join()
    assert {name: r.status_code for name, (r, _) in results.items()} == {n: 200 for n, _, _ in plan}
    finished = sorted(results, key=lambda n: results[n][1])
    assert set(finished[:2]) == {"c1", "c2"} and set(finished[2:]) == {"s1", "s2"}, finished
    assert queued() == 0


def test_the_queue_deadline_answers_503_with_retry_after(engine, model, gateways, queued) -> None:
    results: dict = {}
    with saturated(engine, model, tuple(gateways)):
        started = time.monotonic()
        send(gateways[0], model, "standard", results, "late", **{"x-kvfleet-max-queue-ms": "300"})
        waited = time.monotonic() - started
        r = results["late"][0]
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
        assert "x-kvfleet-max-queue-ms" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
        assert 0.3 <= waited < 5
        assert queued() == 0


def gives_up_and_leaves_the_queue(engine: str, model: str, url: str, queued) -> None:
    with saturated(engine, model, (url,)):
        client = LeavingClient(url, {"model": model, "prompt": "impatient", "max_tokens": 8},
                               **{"x-kvfleet-priority": "critical"})
        until(lambda: queued() == 1, "the request never queued")
        assert client.leave() == b""  # nothing was answered while it waited
        # at once: within the gateway's look at its client (every 0.25 s), long before the 30 s deadline
        until(lambda: queued() == 0, "the abandoned request stayed in the queue", timeout=5.0)
        until(lambda: 'kvfleet_gateway_shed_total{priority="critical",reason="disconnected"} 1.0'
              in httpx.get(f"{url}/metrics").text, "the abandoned request was not counted as shed", timeout=2.0)


def test_a_client_that_gives_up_leaves_the_queue_at_once(engine, model, gateways, queued) -> None:
    """Behind Envoy (the module's gateways) the queued request is the picker's held gRPC stream: when the client
    leaves, Envoy resets it and the entry must leave Redis at once and count as shed, not wait there for a release
    nobody takes."""
    gives_up_and_leaves_the_queue(engine, model, gateways[1], queued)


def test_through_the_python_proxy_a_client_that_gives_up_leaves_the_queue_at_once(engine, model, redis_server_module,
                                                                                  queued) -> None:
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_server_module.url, "--fleet", FLEET,
                              "--saturation-queue", "1", "--data-plane", "python", "--no-critical-first")
    try:
        wait_until_routable(url)
        gives_up_and_leaves_the_queue(engine, model, url, queued)
    finally:
        stop_process(proc)


def test_a_full_class_queue_answers_429_and_other_classes_still_queue(engine, model, gateways, queued) -> None:
    results: dict = {}
    threads = [threading.Thread(target=send, args=(gateways[i % 2], model, "standard", results, f"s{i}"))
               for i in range(4)]
    with saturated(engine, model, tuple(gateways)):
        for t in threads:
            t.start()
        until(lambda: queued() == 4, "four standard requests never queued")
        send(gateways[0], model, "standard", results, "fifth")
        r = results["fifth"][0]
        assert r.status_code == 429 and r.json()["error"]["code"] == "shed_queue_full"
        assert "4 waiting" in r.json()["error"]["message"]
        critical = threading.Thread(target=send, args=(gateways[1], model, "critical", results, "vip"))
        critical.start()
        until(lambda: queued() == 5, "a critical request could not queue beside a full standard class")
    for t in [*threads, critical]:
        t.join()
    assert all(results[n][0].status_code == 200 for n in ["s0", "s1", "s2", "s3", "vip"])
