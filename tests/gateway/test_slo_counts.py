"""Per-class demand and time to first token, counted by real gateways (the Python proxy and Envoy) in front of a real
engine, added into a real Redis, and read back by the operator's reader (kvfleet/fleet/slo_stats.py); plus the
slot arithmetic and the decoding, pure."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
import redis

from kvfleet.fleet import slo_stats
from kvfleet.fleet.priority import Priority
from kvfleet.fleet.redis_keys import slo_slot_key
from kvfleet.fleet.slo import ClassWindow, SloClass
from kvfleet.gateway.limits.usage import StreamUsageMeter, Usage, answer_usage, is_token_event
from kvfleet.gateway.slo_counts import SloCounts
from tests.conftest import free_port, one_sequence_engine_fixtures, start_gateway, stop_process
from tests.support.engines import saturated
from tests.support.gateways import wait_until_routable

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE
MAX_TOKENS = 6

engine, model = one_sequence_engine_fixtures()


def read(url: str | None, fleet: str, window_s: float = 60.0, now: float | None = None) -> dict:
    return asyncio.run(slo_stats.read_class_windows(url, fleet, window_s, now))


def complete(gateway: str, model: str, priority: str, stream: bool, **extra: str) -> httpx.Response:
    body = {"model": model, "prompt": "count me", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    return httpx.post(f"{gateway}/v1/completions", json=body, headers={"x-kvfleet-priority": priority, **extra},
                      timeout=60)


def chat(gateway: str, model: str, priority: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}
    return httpx.post(f"{gateway}/v1/chat/completions", json=body, headers={"x-kvfleet-priority": priority},
                      timeout=60)


def counted(url: str, fleet: str, expect: dict[Priority, tuple[int, int, int]], timeout: float = 10.0) -> dict:
    """The windows once every class shows (arrivals, completed, shed) as expected (flushes are once a second,
    Envoy's access log entries a little later)."""
    deadline = time.monotonic() + timeout
    while True:
        windows = read(url, fleet)
        seen = {p: (windows[p].arrivals, windows[p].completed, windows[p].shed) for p in expect} if windows else {}
        if seen == expect:
            return windows
        if time.monotonic() > deadline:
            raise AssertionError(f"counted {seen}, expected {expect}")
        time.sleep(0.2)


@pytest.mark.parametrize("data_plane", ["python", "envoy"])
def test_gateways_count_each_class_and_the_reader_sums_them(engine, model, redis_server, data_plane) -> None:
    fleet = f"slo-{data_plane}"
    proc, gateway = start_gateway("--engine", engine, "--redis-url", redis_server.url, "--fleet", fleet,
                                  "--saturation-queue", "1", "--data-plane", data_plane)
    try:
        wait_until_routable(gateway)
        # answered: critical streamed (completions and chat) and not, standard both ways
        answers = [complete(gateway, model, "critical", stream=True), chat(gateway, model, "critical"),
                   complete(gateway, model, "critical", stream=False), complete(gateway, model, "standard", True),
                   complete(gateway, model, "standard", stream=False)]
        assert [r.status_code for r in answers] == [200] * 5
        assert all("usage" not in line for r in answers[:2] for line in r.text.splitlines())  # still hidden
        # hostile: a made-up class is refused with the existing 400 and counted as no class at all
        bogus = complete(gateway, model, "urgent!!", stream=False)
        assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "x-kvfleet-priority"
        with saturated(engine, model, (gateway,)):
            shed = complete(gateway, model, "sheddable", stream=False)
            assert shed.status_code == 429 and shed.json()["error"]["code"] == "shed_saturated"
            late = complete(gateway, model, "standard", stream=False, **{"x-kvfleet-max-queue-ms": "200"})
            assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
        windows = counted(redis_server.url, fleet, {C: (3, 3, 0), S: (3, 2, 1), X: (1, 0, 1)})
    finally:
        stop_process(proc)

    critical, standard, sheddable = windows[C], windows[S], windows[X]
    assert critical.output_tokens == 3 * MAX_TOKENS and standard.output_tokens == 2 * MAX_TOKENS
    assert sheddable.output_tokens == 0 and sheddable.ttft_buckets[-1] == (math.inf, 0)
    assert critical.prompt_tokens > 0 and standard.prompt_tokens > 0
    assert critical.ttft_buckets[-1] == (math.inf, 3) and standard.ttft_buckets[-1] == (math.inf, 2)
    assert critical.queued == standard.queued == 0
    assert 59.0 <= critical.window_s < 60.0 + slo_stats.SLOT_S
    # every answer's first token came within a generous objective, hardly any within a millisecond
    assert critical.attainment(SloClass(60.0, 0.5)) == 1.0
    assert critical.attainment(SloClass(0.001, 0.5)) < 1.0
    # a shed request is a miss: 2 of standard's 3 met even the generous objective
    assert standard.attainment(SloClass(60.0, 0.5)) == pytest.approx(2 / 3)
    assert sheddable.attainment(SloClass(60.0, 0.5)) == 0.0
    # nothing stays: each slot's hash expires
    client = redis.Redis.from_url(redis_server.url)
    keys = client.keys(slo_slot_key(fleet, 0).replace(":0", ":*"))
    assert keys and all(0 < client.ttl(k) <= slo_stats.STATS_TTL_S for k in keys)
    # a window that ended before the requests holds none of them
    then = time.time() - 600
    assert read(redis_server.url, fleet, 30.0, now=then)[C] == ClassWindow(
        slo_stats.window_slots(then, 30.0)[1], ttft_buckets=((math.inf, 0),))


def test_a_queued_request_shows_in_its_class(engine, model, redis_server) -> None:
    fleet = "slo-queued"
    proc, gateway = start_gateway("--engine", engine, "--redis-url", redis_server.url, "--fleet", fleet,
                                  "--saturation-queue", "1", "--data-plane", "python")
    try:
        wait_until_routable(gateway)
        with saturated(engine, model, (gateway,)):
            waiter = threading.Thread(target=complete, args=(gateway, model, "standard", False))
            waiter.start()
            deadline = time.monotonic() + 10
            while (read(redis_server.url, fleet).get(S) or ClassWindow(1.0)).queued != 1:
                assert time.monotonic() < deadline, "the queued standard request never showed"
                time.sleep(0.1)
        waiter.join()
        counted(redis_server.url, fleet, {S: (1, 1, 0), C: (0, 0, 0)})
    finally:
        stop_process(proc)


def test_without_redis_the_reader_says_nothing_and_the_counter_drops_its_counts() -> None:
    assert read(None, "f") == {}
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert read(dead, "f") == {}

    async def flush_to_nobody() -> SloCounts:
        from redis.asyncio import Redis

        counts = SloCounts(Redis.from_url(dead, socket_connect_timeout=0.5), "f")
        counts.arrived(C, 10)
        await counts.flush()  # no exception: dropped, logged
        await counts.client.aclose()
        return counts
    assert asyncio.run(flush_to_nobody()).pending == {}


def test_slots_and_windows() -> None:
    assert [slo_stats.slot_start(t) for t in (1000.0, 1004.99, 1005.0)] == [1000, 1000, 1005]
    # a 60 s window at 1002.5: the slots overlapping (942.5, 1002.5], covering 62.5 s up to now
    assert slo_stats.window_slots(1002.5, 60.0) == (list(range(940, 1001, 5)), 62.5)
    starts, covered = slo_stats.window_slots(1000.0, 10.0)
    assert starts == [990, 995, 1000] and covered == 10.0
    starts, covered = slo_stats.window_slots(10_000.0, 10 * slo_stats.STATS_TTL_S)  # never more than the TTL keeps
    assert covered <= slo_stats.STATS_TTL_S and len(starts) <= slo_stats.STATS_TTL_S // slo_stats.SLOT_S


def test_ttft_buckets_hold_the_default_objectives_and_decode_cumulatively() -> None:
    bounds = slo_stats.TTFT_BUCKETS
    assert {1.0, 2.0, 5.0} <= set(bounds) and list(bounds) == sorted(bounds)
    assert [slo_stats.ttft_bucket(t) for t in (0.0, 1.0, 1.01, 1e6)] == ["ttft_le:0.05", "ttft_le:1", "ttft_le:1.5",
                                                                      "ttft_le:inf"]
    slots = [{b"critical:arrivals": b"3", b"critical:completed": b"2", b"critical:ttft_le:1": b"1",
              b"critical:ttft_le:inf": b"1", b"critical:output_tokens": b"40", b"bogus:arrivals": b"9",
              b"critical:nonsense": b"1", b"critical:shed": b"not a number"},
             {"critical:arrivals": "1", "critical:shed": "1", "critical:ttft_le:0.5": "1", "critical:completed": "1",
              "critical:prompt_tokens": "12"}]
    windows = slo_stats.decode_class_windows(slots, 60.0, {b"critical": b"4"})
    critical = windows[C]
    assert (critical.arrivals, critical.completed, critical.shed, critical.output_tokens) == (4, 3, 1, 40)
    assert critical.prompt_tokens == 12 and critical.queued == 4 and critical.window_s == 60.0
    assert critical.ttft_buckets == ((0.5, 1), (1.0, 2), (math.inf, 3))
    assert critical.attainment(SloClass(1.0, 0.9)) == pytest.approx(2 / 4)  # 2 within 1 s of 3 answered + 1 shed
    assert windows[S] == ClassWindow(60.0, ttft_buckets=((math.inf, 0),))


def test_the_counter_counts_an_answer_only_once_a_token_came() -> None:
    clock = [1000.0]
    counts = SloCounts(object(), "f", clock=lambda: clock[0])  # a client is only needed to flush
    counts.arrived(S, 7)
    counts.answered(S, 10.0, Usage(0))  # an error: no token
    counts.answered(S, 10.0, Usage(20, completion=5, first_token_at=10.25))
    clock[0] = 1007.0
    counts.answered(S, 10.0, Usage(None, streamed_events=3, first_token_at=12.5))  # cut short: its events
    counts.shed(S)
    windows = slo_stats.decode_class_windows([{f: n for (slot, f), n in counts.pending.items() if slot == s}
                                    for s in (1000, 1005)], 10.0)
    standard = windows[S]
    assert (standard.arrivals, standard.prompt_tokens, standard.completed, standard.output_tokens,
            standard.shed) == (1, 7, 2, 8, 1)
    assert standard.ttft_buckets == ((0.3, 1), (3.0, 2), (math.inf, 2))
    assert json.dumps(sorted({slot for slot, _ in counts.pending})) == "[1000, 1005]"


def test_a_streams_first_token_is_its_first_token_event_not_the_role_announcement() -> None:
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}\n\n'
    assert [is_token_event(e) for e in (role, token, usage, b'data: {"error": {"message": "x"}}\n\n')] == [
        False, True, False, False]
    meter = StreamUsageMeter(hide_usage=True)
    meter.feed(role)
    assert meter.usage.first_token_at is None
    before = time.monotonic()
    meter.feed(token + usage)
    assert before <= meter.usage.first_token_at <= time.monotonic()
    assert (meter.usage.total, meter.usage.completion) == (3, 1)
    answer = answer_usage(200, b'{"usage": {"total_tokens": 9, "completion_tokens": 4}}', received_at=12.0)
    assert (answer.total, answer.completion, answer.first_token_at) == (9, 4, 12.0)
    assert answer_usage(500, b'{"error": {}}', received_at=12.0).first_token_at is None  # no answer, no token
