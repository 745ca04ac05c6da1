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
from kvfleet.gateway.queue.wait import MIN_RELEASES, drain_rate, max_ahead, predicted_wait_s, retry_after_s
from tests.support.queues import release_all, replica, running

S, X = Priority.STANDARD, Priority.SHEDDABLE


def test_the_drain_rate_is_releases_after_the_first_over_the_time_since_it() -> None:
    now = 1000.5
    assert drain_rate([], now) is None
    assert drain_rate([1000.1, 1000.2], now) is None  # too few to tell: nobody is refused on it
    assert drain_rate([1000.0] * 4, now) is None  # one burst of room taken at once: no rate yet
    assert drain_rate([991.0 + i / 3 for i in range(28)], now) == pytest.approx(3.0, rel=0.1)
    assert drain_rate([997.5, 998.5, 999.5, 1000.5], now) == pytest.approx(1.0)  # since they began
    assert drain_rate([900.0] * 50 + [999.5, 1000.0, 1000.5], now) == pytest.approx(2.0)  # outside the window


@pytest.mark.parametrize("rate", [0.5, 2.0, 13.0, 80.0])
@pytest.mark.parametrize("begun_at", [100.0, 100.37, 100.93])
def test_a_queue_that_just_began_to_drain_is_quoted_its_real_rate_not_a_fraction_of_it(rate: float,
                                                                                       begun_at: float) -> None:
    """A fast fleet's queue drains several entries within its first second: the rate quoted from its first few
    releases is the rate it runs at, wherever in the wall-clock second the drain began (whole seconds quoted ~4/s
    for 13/s here: deadlines refused and Retry-After told three times too long on a fast CPU)."""
    releases = [begun_at + i / rate for i in range(MIN_RELEASES)]  # the first moment a rate can be told
    for since_last in (0.0, 0.5 / rate, 0.99 / rate):
        quoted = drain_rate(releases, releases[-1] + since_last)
        assert quoted == pytest.approx(rate, rel=0.4), (quoted, since_last)


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


def test_the_redis_queue_keeps_each_releases_time_to_the_millisecond_fleet_wide(redis_server) -> None:
    """Two replicas release in turn at known times (a drain of 5 per second begun late in a wall-clock second):
    the rate either replica reads is that drain's, and releases older than the window no longer count."""
    async def scenario() -> None:
        a, b = (replica(redis_server.url, name, fleet="drain-times") for name in ("a", "b"))
        async with running(a, b):
            for q in (a, b, a, b):
                await q.enqueue(S, 60_000, "t", 1.0)
            begun_ms = (int(time.time()) + 0.9) * 1000.0
            for i, q in enumerate((a, b, a, b)):
                assert len(await q.redis.release(1, begun_ms + i * 200.0, window_ms=1)) == 1
                await asyncio.sleep(0.005)  # past the release window (real time)
            for q in (a, b):
                times = await q.redis.drained(begun_ms + 700.0)
                assert drain_rate(times, (begun_ms + 700.0) / 1000) == pytest.approx(3 / 0.7)
            later_ms = begun_ms + 10_000.0 + 300.0  # the first two have left the window
            assert len(await a.redis.drained(later_ms)) == 2
    asyncio.run(scenario())
