"""Deadline awareness and per-tenant queue caps in the fleet queue, on a real Redis server and in-process: the
fleet's drain rate is measured from releases, a request whose queue ahead cannot drain by its deadline is refused at
once with an estimate of the wait, a tenant's own entries go earliest deadline first, and a tenant at its cap of
queued entries is refused while others still queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.order import Refusal
from kvfleet.gateway.queue.wait import (
    DRAIN_SAMPLE,
    MIN_RELEASES,
    drain_rate,
    max_ahead,
    predicted_wait_s,
    retry_after_s,
)
from tests.support.queues import release_all, replica, running

S, X = Priority.STANDARD, Priority.SHEDDABLE


def waited(queued: float, *released: float) -> list[tuple[float, float]]:
    """Entries all queued at `queued` and released at the given times, as drain_rate takes them."""
    return [(queued, r) for r in released]


def test_the_drain_rate_is_releases_over_the_time_the_queue_held_entries() -> None:
    now = 1000.5
    assert drain_rate([], now) is None
    assert drain_rate(waited(1000.0, 1000.1, 1000.2), now) is None  # too few to tell: nobody is refused on it
    assert drain_rate(waited(1000.0, *[1000.0] * 4), now) is None  # queued and released at one instant: no time
    # a steady drain through the window: 3 a second
    assert drain_rate([(990.0 + i / 3, 991.0 + i / 3) for i in range(28)], now) == pytest.approx(3.0, rel=0.1)
    # four queued at once, released a second apart, the last still queued behind them: since they were queued
    assert drain_rate(waited(997.0, 997.5, 998.5, 999.5, 1000.5), now, busy_since_s=997.0) == pytest.approx(4 / 3.5)
    assert drain_rate(waited(900.0, *[900.0] * 50) + waited(999.0, 999.5, 1000.0, 1000.5), now) == pytest.approx(2.0)


def test_the_drain_rate_counts_only_the_time_the_queue_held_entries() -> None:
    """A queue that forms for a moment now and then, while most requests go straight to an engine, released few
    entries over a long time: the idle time between does not describe the fleet. What a CI machine saw (the rate
    then was releases over the time since the first): three releases in a moment 10 s ago and two now quoted
    0.19/s for a fleet serving 2/s, and a request 5 behind was refused for an 18 s deadline it would have met."""
    now = 1000.0
    flickers = waited(990.0, 990.4, 990.5, 990.6) + waited(999.0, 999.5, 1000.0)
    assert drain_rate(flickers, now, busy_since_s=999.0) == pytest.approx(5 / 1.6)
    # the queue held entries all along: the whole window counts
    steady = [(989.0 + i / 4, 990.0 + i / 4) for i in range(1, 41)]
    assert drain_rate(steady, now, busy_since_s=980.0) == pytest.approx(4.0, rel=0.05)
    # more releases than the sample holds: over the sample's own span, the oldest not counted
    fast = [(now - 1.0 - i / 20, now - i / 20) for i in range(DRAIN_SAMPLE)]
    assert drain_rate(fast, now, busy_since_s=900.0) == pytest.approx(20.0, rel=0.05)
    # a stall: the queue holds entries and nothing left it lately
    assert drain_rate(waited(990.5, 991.0, 991.5, 992.0), now, busy_since_s=990.5) == pytest.approx(3 / 9.5)
    # replicas' clocks apart: a release "before" its queued time waited no time, and breaks nothing
    assert drain_rate(waited(995.0, 994.9, 996.0, 997.0), now, busy_since_s=None) == pytest.approx(3 / 2.0)


@pytest.mark.parametrize("rate", [0.5, 2.0, 13.0, 80.0])
@pytest.mark.parametrize("begun_at", [100.0, 100.37, 100.93])
def test_a_queue_that_just_began_to_drain_is_quoted_its_real_rate_not_a_fraction_of_it(rate: float,
                                                                                       begun_at: float) -> None:
    """A fast fleet's queue drains several entries within its first second: the rate quoted from its first few
    releases is the rate it runs at, wherever in the wall-clock second the drain began (whole seconds quoted ~4/s
    for 13/s here: deadlines refused and Retry-After told three times too long on a fast CPU)."""
    formed = begun_at - 1 / rate  # the first room opened a release's time after the queue formed
    releases = waited(formed, *(begun_at + i / rate for i in range(MIN_RELEASES)))
    for since_last in (0.0, 0.5 / rate, 0.99 / rate):
        quoted = drain_rate(releases, releases[-1][1] + since_last, busy_since_s=formed)
        assert quoted == pytest.approx(rate, rel=0.4), (quoted, since_last)


@pytest.mark.parametrize("where", ["redis", "in-process"])
def test_a_queue_that_formed_again_is_quoted_the_rate_it_drains_at_now(redis_server, where: str) -> None:
    """The queue's busy period is kept where its entries are (Redis, or this process): releases from an earlier
    one, and the idle time since, leave the rate a request is told."""
    async def scenario() -> None:
        q = replica(redis_server.url if where == "redis" else None, "gw", fleet=f"busy-{where}")
        async with running(q):
            early = [await q.enqueue(S, 60_000, "t", 1.0) for _ in range(3)]
            await release_all([q], early, every_s=0.05)  # a moment's queue, drained at once
            early_busy = time.time() - early[0].arrival_ms / 1000.0
            await asyncio.sleep(1.5)  # then no queue: requests would go straight to engines
            formed = time.time()
            again = [await q.enqueue(S, 60_000, "t", 1.0) for _ in range(5)]
            await release_all([q], again[:4], every_s=0.1)
            await q.refresh_counts()
            rate, busy_for = q.drain_rate_per_s(), time.time() - formed
            # seven releases over the ~0.55 s the queue held entries (over the ~2 s since the first: 3/s)
            assert rate == pytest.approx(7 / (early_busy + busy_for), rel=0.25), (rate, early_busy, busy_for)
            assert rate > 2 * 6 / (time.time() - early[0].arrival_ms / 1000.0)
    asyncio.run(scenario())


def test_a_request_may_wait_behind_what_drains_by_its_deadline_and_is_told_when_to_come_back() -> None:
    assert max_ahead(None, 5000) is None
    assert max_ahead(2.0, 5000) == 9  # the 10th release is at 5 s
    assert max_ahead(2.0, 100) == 0  # first in line always waits: the next free slot is no rate's to predict
    assert predicted_wait_s(19, 2.0) == 10.0
    assert retry_after_s(19, 2.0, max_wait_ms=4000) == 8  # then the queue ahead is half what 4 s allows
    assert retry_after_s(19, 2.0) == 10
    assert retry_after_s(0, 100.0) == 1 and retry_after_s(10**9, 0.001) == 3600
    assert retry_after_s(5, None) >= 1


@pytest.mark.parametrize("where", ["redis", "in-process"])
def test_a_request_that_cannot_be_served_by_its_deadline_is_refused_at_once(redis_server, where: str) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url if where == "redis" else None, "gw", fleet=f"deadline-{where}")
        async with running(q):
            first = [await q.enqueue(S, 60_000, "flood", 1.0) for _ in range(4)]
            assert q.drain_rate_per_s() is None
            # four releases a scrape interval or so apart, as a gateway's passes make them: a rate can be told
            await release_all([q], first, every_s=0.1)
            await q.refresh_counts()
            rate = q.drain_rate_per_s()
            assert rate is not None and rate > 0
            short_ms = 1000.0  # well under the ~4 s the backlog takes at that rate
            # the flood's backlog, each due a little sooner than the next request (a tenant's own go by deadline)
            backlog = [await q.enqueue(S, short_ms - 100, "flood", 1.0) for _ in range(int(rate * 4) + 5)]
            assert all(backlog)
            entry, placement = await q.place(S, short_ms, "flood", 1.0)
            assert placement.refusal is Refusal.TOO_LONG and placement.ahead == len(backlog)
            assert q.total() == len(backlog)  # the refused one left nothing behind
            assert predicted_wait_s(placement.ahead, rate) > short_ms / 1000
            # another tenant's request goes ahead of most of the flood (they take turns): it may wait
            _, light = await q.place(S, short_ms, "light", 1.0)
            assert light.queued and light.ahead == 1
            # and a flood request with a long deadline still queues, told how much is ahead
            _, patient = await q.place(S, 600_000, "flood", 1.0)
            assert patient.queued and patient.ahead == len(backlog) + 1
    asyncio.run(scenario())


@pytest.mark.parametrize("where", ["redis", "in-process"])
def test_a_tenant_at_its_queued_cap_is_refused_while_others_still_queue(redis_server, where: str) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url if where == "redis" else None, "gw", fleet=f"caps-{where}")
        async with running(q):
            for priority in (S, S, X):  # the cap counts the tenant's entries in every class
                _, placed = await q.place(priority, 60_000, "flood", 1.0, tenant_cap=3)
                assert placed.queued
            _, refused = await q.place(S, 60_000, "flood", 1.0, tenant_cap=3)
            assert refused.refusal is Refusal.TENANT_FULL and refused.ahead == 3
            _, other = await q.place(S, 60_000, "light", 1.0, tenant_cap=3)
            assert other.queued
            assert q.total() == 4
    asyncio.run(scenario())


@pytest.mark.parametrize("where", ["redis", "in-process"])
def test_a_tenants_own_requests_go_earliest_deadline_first(redis_server, where: str) -> None:
    async def scenario() -> list[str]:
        q = replica(redis_server.url if where == "redis" else None, "gw", fleet=f"edf-{where}")
        async with running(q):
            relaxed = await q.enqueue(S, 300_000, "team", 1.0)
            await asyncio.sleep(0.002)
            urgent = await q.enqueue(S, 20_000, "team", 1.0)
            await asyncio.sleep(0.002)
            middle = await q.enqueue(S, 60_000, "team", 1.0)
            order = await release_all([q], [relaxed, urgent, middle])
            names = {relaxed.id: "relaxed", urgent.id: "urgent", middle.id: "middle"}
            return [names[i] for i in order]
    assert asyncio.run(scenario()) == ["urgent", "middle", "relaxed"]


def test_an_expired_entry_still_ends_its_wait(redis_server) -> None:
    """A deadline-aware queue still answers the requests it took at their deadline (nothing hangs)."""
    async def scenario() -> None:
        q = replica(redis_server.url, "gw", fleet="expiry")
        async with running(q):
            entry, placed = await q.place(S, 200, "t", 1.0)
            assert placed.queued
            assert (await q.wait(entry)).value == "expired"
            assert await q.refresh_counts() == 0
    asyncio.run(scenario())


def test_the_redis_queue_keeps_each_releases_times_to_the_millisecond_fleet_wide(redis_server) -> None:
    """Two replicas queue and release in turn at known times (a drain of 5 per second begun late in a wall-clock
    second): either replica reads each entry's queued and released times as they were, the queue's busy period
    while it holds entries, and releases older than the window no longer count."""
    async def scenario() -> None:
        a, b = (replica(redis_server.url, name, fleet="drain-times") for name in ("a", "b"))
        async with running(a, b):
            entries = [await q.enqueue(S, 60_000, "t", 1.0) for q in (a, b, a, b)]
            queued = sorted(e.arrival_ms / 1000.0 for e in entries)
            await a.refresh_counts()
            _, busy_since = await a.redis.drained(time.time() * 1000.0)
            assert busy_since == pytest.approx(queued[0], abs=0.001)  # the first one began it
            begun_ms = (int(time.time()) + 1.9) * 1000.0  # late in a second still to come: after every queued time
            for i, q in enumerate((a, b, a, b)):
                assert len(await q.redis.release(1, begun_ms + i * 200.0, window_ms=1)) == 1
                await asyncio.sleep(0.005)  # past the release window (real time)
            for q in (a, b):
                releases, busy_since = await q.redis.drained(begun_ms + 700.0)
                assert busy_since is None  # all four released: the queue is empty
                assert sorted(r for _, r in releases) == [(begun_ms + i * 200.0) / 1000.0 for i in range(4)]
                assert sorted(w for w, _ in releases) == pytest.approx(queued, abs=0.001)
                assert drain_rate(releases, (begun_ms + 700.0) / 1000) == pytest.approx(
                    4 / ((begun_ms + 600.0) / 1000 - queued[0]))
            later_ms = begun_ms + 10_000.0 + 300.0  # the first two have left the window
            assert len((await a.redis.drained(later_ms))[0]) == 2
    asyncio.run(scenario())
