"""Tenants and fair share end to end: a real engine that runs one sequence at a time, real gateways on one real
Redis, clients over HTTP. A light tenant's request overtakes a flood's backlog under `--queue-policy fair` and waits
behind all of it under `fcfs`; the tenant header is checked without API keys and ignored with them."""

from __future__ import annotations

import threading

import httpx
import redis

from kvfleet.fleet.redis_keys import queue_band_idle_key, queue_key
from tests.conftest import one_sequence_engine_fixtures, start_gateway, stop_process
from tests.support.clients import send
from tests.support.engines import saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

engine, model = one_sequence_engine_fixtures()

TENANT = "x-kvfleet-tenant"
FLOOD = 10


def gateway(engine: str, redis_url: str, fleet: str, *extra: str):
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_url, "--fleet", fleet,
                              "--saturation-queue", "1", *extra)
    wait_until_routable(url)
    return proc, url


def light_place_behind_a_flood(engine: str, model: str, url: str, queued) -> int:
    """Where, in the order answers finished, a light tenant's one request lands behind a flood queued before it."""
    results: dict = {}
    threads = [threading.Thread(target=send, args=(url, model, "standard", results, f"flood{i}"),
                                kwargs={TENANT: "flood"}) for i in range(FLOOD)]
    light = threading.Thread(target=send, args=(url, model, "standard", results, "light"), kwargs={TENANT: "light"})
    with saturated(engine, model, (url,)):
        for t in threads:
            t.start()
        until(lambda: queued() == FLOOD, "the flood never queued")
        light.start()
        until(lambda: queued() == FLOOD + 1, "the light request never queued")
    for t in [*threads, light]:
        t.join()
    assert all(r.status_code == 200 for r, _ in results.values()), results
    return sorted(results, key=lambda n: results[n][1]).index("light")


def test_a_light_tenant_overtakes_a_floods_backlog_with_fair_share_not_with_fcfs(engine, model,
                                                                                 redis_server) -> None:
    store = redis.Redis.from_url(redis_server.url)
    places = {}
    for policy in ("fair", "fcfs"):
        proc, url = gateway(engine, redis_server.url, policy, "--queue-policy", policy)
        try:
            places[policy] = light_place_behind_a_flood(engine, model, url, lambda p=policy: store.zcard(queue_key(p)))
        finally:
            stop_process(proc)
    print(f"the light tenant's request finished at place {places} of {FLOOD + 1}")
    assert places["fair"] <= 2  # next to be released once the engine had room (a tie with the flood at most)
    assert places["fcfs"] >= FLOOD - 2  # behind the backlog (two released together may finish in either order)


def test_the_tenant_header_is_checked_without_keys_and_ignored_with_them(engine, model, redis_server,
                                                                           tmp_path) -> None:
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    keys = tmp_path / "keys"
    keys.write_text("sk-team-a name=team-a weight=2\n")
    open_proc, open_url = gateway(engine, redis_server.url, "open", "--data-plane", "python")
    keyed_proc, keyed_url = gateway(engine, redis_server.url, "keyed", "--data-plane", "python",
                                    "--api-keys-file", str(keys))
    try:
        bad = httpx.post(f"{open_url}/v1/completions", json=body, headers={TENANT: "team a!"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == TENANT
        assert "letters, digits" in bad.json()["error"]["message"]
        ok = httpx.post(f"{open_url}/v1/completions", json=body, headers={TENANT: "team-b"}, timeout=30)
        assert ok.status_code == 200
        # sent at once, charged to the header's tenant: the estimate, corrected to the engine's count at the end
        open_idle = queue_band_idle_key("open", "standard")
        until(lambda: store.zscore(open_idle, "team-b") == ok.json()["usage"]["total_tokens"],
              "the header's tenant was not charged its answer's tokens", 5)
        claimed = httpx.post(f"{keyed_url}/v1/completions", json=body, timeout=30,
                             headers={TENANT: "team a!", "authorization": "Bearer sk-team-a"})
        assert claimed.status_code == 200  # the header is not read when keys say who the tenant is
        keyed_idle = queue_band_idle_key("keyed", "standard")
        until(lambda: store.zrange(keyed_idle, 0, -1, withscores=True)
              == [("team-a", claimed.json()["usage"]["total_tokens"] / 2)],
              "the key's name was not the tenant charged, or not by its weight", 5)
    finally:
        stop_process(open_proc)
        stop_process(keyed_proc)
