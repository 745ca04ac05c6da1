"""Deadlines and per-tenant caps end to end: a real engine that runs one sequence at a time, a real gateway on one
real Redis, clients over HTTP. A request whose queue ahead cannot drain by its deadline is answered at once with a
wait estimate and a Retry-After from the rate the queue really drained at; a tenant at its cap of queued or unfinished
requests gets a 429 that says which cap, while other tenants are served."""

from __future__ import annotations

import re
import threading
import time

import httpx
import redis

from kvfleet.fleet.redis_keys import queue_key, tenant_inflight_key
from tests.conftest import one_sequence_engine_fixtures, start_gateway, stop_process
from tests.support.clients import send
from tests.support.engines import saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

engine, model = one_sequence_engine_fixtures()

TENANT, MAX_QUEUE_MS = "x-kvfleet-tenant", "x-kvfleet-max-queue-ms"


def gateway(engine: str, redis_url: str, fleet: str, *extra: str):
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_url, "--fleet", fleet, "--data-plane",
                              "python", "--saturation-queue", "1", *extra)
    wait_until_routable(url)
    return proc, url


def drain_rate(gateway: str) -> float:
    """The fleet queue's drain rate the gateway decides deadlines by, from its /metrics."""
    text = httpx.get(f"{gateway}/metrics", timeout=5).text
    return float(re.search(r"^kvfleet_gateway_queue_drain_rate ([0-9.e+-]+)$", text, re.M).group(1))


BACKLOG = 20


def test_a_request_that_cannot_be_served_by_its_deadline_is_answered_at_once_with_an_honest_retry_after(
        engine, model, redis_server) -> None:
    store = redis.Redis.from_url(redis_server.url)
    proc, url = gateway(engine, redis_server.url, "deadlines")
    results: dict = {}
    # twenty tenants' requests of ~64 tokens each through the engine: a backlog of several seconds. With six of them
    # answered, fourteen are ahead of the late request: about twice its 1 s deadline where the queue drains fastest
    # (7/s on a 2-core EPYC with AVX-512 BF16, 2026-12-07; with fourteen, eight ahead came within 15 % of the
    # deadline there, and the late request was once rightly admitted)
    backlog = [threading.Thread(target=send, args=(url, model, "standard", results, f"t{i}"),
                                kwargs={"max_tokens": 64, TENANT: f"t{i}"}) for i in range(BACKLOG)]
    try:
        with saturated(engine, model, (url,)):
            for t in backlog:
                t.start()
            until(lambda: store.zcard(queue_key("deadlines")) == BACKLOG, "the backlog never queued")
        # six answered: the rate they came at is measured over five of the engine's turns, not one or two
        until(lambda: len(results) >= 6, "the queue never drained six requests", 120)
        # the gateway has measured the drain rate (without one it refuses nobody: the request would be queued)
        until(lambda: drain_rate(url) > 0, "the gateway never measured the queue's drain rate")
        served = sorted(at for _, at in list(results.values()))  # the backlog's answers so far
        asked = time.monotonic()
        late = httpx.post(f"{url}/v1/completions", timeout=30, headers={TENANT: "late", MAX_QUEUE_MS: "1000"},
                          json={"model": model, "prompt": "late", "max_tokens": 4})
        answered_in = time.monotonic() - asked
        ahead = store.zcard(queue_key("deadlines"))
        for t in backlog:
            t.join()
        drained_in = max(at for _, at in results.values()) - asked  # what the queue ahead really took
        assert all(r.status_code == 200 for r, _ in results.values())
    finally:
        stop_process(proc)
    assert late.status_code == 503, (late.status_code, late.text[:300], ahead)
    error = late.json()["error"]
    observed = (len(served) - 1) / (served[-1] - served[0])  # the backlog's answers before the request came
    print(f"answered in {answered_in:.2f} s with {ahead} queued: {error['message']!r}, Retry-After "
          f"{late.headers['retry-after']}; the backlog was answered at {observed:.2f}/s before it, and the queue "
          f"ahead drained in {drained_in:.1f} s after")
    assert late.status_code == 503 and error["code"] == "queue_deadline_unreachable"
    assert answered_in < 1.0  # at once, not after its 1 s deadline
    assert MAX_QUEUE_MS in error["message"] and "allow a longer wait" in error["message"]
    predicted = float(re.search(r"about ([0-9.]+) s of queued work", error["message"]).group(1))
    quoted_ahead, quoted_rate = re.search(r"\(([0-9]+) requests?, the fleet serving ([0-9.]+)/s\)",
                                          error["message"]).groups()
    # the prediction is the queue ahead (and this request) at the rate the gateway measured ...
    assert abs(predicted - (int(quoted_ahead) + 1) / float(quoted_rate)) <= 0.05 * predicted + 0.1, error["message"]
    # ... and that rate is the rate the queue was draining at: the backlog's answers before the request came, one
    # released as each ended. Judged against the past, not the drain still to come, which a machine whose speed
    # changes over the next seconds (a shared CI machine) can make two or three times longer than any estimate.
    # The gateway's count of releases includes the slots the engine freed at once when the block above ended.
    assert 0.4 * observed <= float(quoted_rate) <= 2.5 * observed, (quoted_rate, observed, served)
    retry_after = int(late.headers["retry-after"])
    # Retry-After is that same prediction (less half the 1 s it could have waited, in whole seconds), so it is as
    # honest as the prediction judged above; an absolute slack over the real drain would judge the machine's speed
    assert retry_after >= 1 and predicted - 0.6 <= retry_after <= predicted + 0.6, (retry_after, predicted)


def test_a_tenant_at_its_queued_cap_gets_429_while_other_tenants_still_queue(engine, model, redis_server) -> None:
    store = redis.Redis.from_url(redis_server.url)
    proc, url = gateway(engine, redis_server.url, "queued-cap", "--tenant-max-queued", "2")
    results: dict = {}
    try:
        with saturated(engine, model, (url,)):
            first = [threading.Thread(target=send, args=(url, model, "standard", results, f"big{i}"),
                                      kwargs={TENANT: "big"}) for i in range(2)]
            for t in first:
                t.start()
            until(lambda: store.zcard(queue_key("queued-cap")) == 2, "the tenant's two requests never queued")
            over = httpx.post(f"{url}/v1/completions", timeout=30, headers={TENANT: "big"},
                              json={"model": model, "prompt": "one more", "max_tokens": 2})
            other = threading.Thread(target=send, args=(url, model, "standard", results, "small"),
                                     kwargs={TENANT: "small"})
            other.start()
            until(lambda: store.zcard(queue_key("queued-cap")) == 3, "another tenant could not queue")
        for t in [*first, other]:
            t.join()
    finally:
        stop_process(proc)
    assert over.status_code == 429 and over.json()["error"]["code"] == "shed_tenant_queue_full"
    assert "'big' already has 2 requests waiting" in over.json()["error"]["message"]
    assert int(over.headers["retry-after"]) >= 1
    assert {name: r.status_code for name, (r, _) in results.items()} == {"big0": 200, "big1": 200, "small": 200}


def test_a_tenant_at_its_in_flight_cap_gets_429_until_one_ends_and_a_keys_cap_overrides_the_default(
        engine, model, redis_server, tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-one name=one max_inflight=1\nsk-many name=many\n")
    store = redis.Redis.from_url(redis_server.url)
    proc, url = gateway(engine, redis_server.url, "inflight-cap", "--tenant-max-inflight", "3",
                        "--api-keys-file", str(keys))
    body = {"model": model, "prompt": "a long one", "max_tokens": 900, "ignore_eos": True, "stream": True}

    def holding(key: str, stop: threading.Event, started: threading.Event) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break

    def ask(key: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", timeout=60, headers={"authorization": f"Bearer {key}"},
                          json={"model": model, "prompt": "short", "max_tokens": 2})

    try:
        stop, started = threading.Event(), threading.Event()
        holder = threading.Thread(target=holding, args=("sk-one", stop, started))
        holder.start()
        assert started.wait(60), "the holding stream never started"
        refused = ask("sk-one")  # its key's cap is 1, below the gateway's default of 3
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "shed_tenant_inflight_full"
        assert "'one' already has 1 requests admitted and unfinished" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert store.zcard(tenant_inflight_key("inflight-cap", "one")) == 1
        stop.set()  # the client leaves mid-stream
        holder.join()
        assert ask("sk-many").status_code == 200  # another tenant was never held to that cap
        until(lambda: store.zcard(tenant_inflight_key("inflight-cap", "one")) == 0,
              "the ended stream still holds its tenant's slot", 10)
        assert ask("sk-one").status_code == 200  # its slot was given back when the stream ended
        until(lambda: store.zcard(tenant_inflight_key("inflight-cap", "one")) == 0, "a slot stayed taken", 10)
    finally:
        stop_process(proc)
