"""Deadline awareness and per-tenant queue caps in the fleet queue, on a real Redis server and in-process: the
fleet's drain rate is measured from releases, a request whose queue ahead cannot drain by its deadline is refused at
once with an estimate of the wait, a tenant's own entries go earliest deadline first, and a tenant at its cap of
queued entries is refused while others still queue."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.order import Refusal
from kvfleet.gateway.queue.wait import DRAIN_WINDOW_S, drain_rate, max_ahead, predicted_wait_s, retry_after_s
from tests.test_fair_queue import never_disconnects, release_all, replica, running

S, X = Priority.STANDARD, Priority.SHEDDABLE


def test_the_drain_rate_is_releases_per_second_over_the_window_or_since_they_began() -> None:
    now = 1000.5
    assert drain_rate({}, now) is None
    assert drain_rate({1000: 2}, now) is None  # too few to tell: nobody is refused on it
    assert drain_rate({1000 - s: 3 for s in range(DRAIN_WINDOW_S)}, now) == pytest.approx(3.0, rel=0.1)
    assert drain_rate({997: 4, 998: 4, 999: 4, 1000: 2}, now) == pytest.approx(14 / 3.5)  # since they began
    assert drain_rate({900: 50, 1000: 3}, now) == pytest.approx(3.0)  # long ago: outside the window


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
            await release_all([q], first)  # four releases: now the fleet's rate can be told
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
            assert (await q.wait(entry, never_disconnects)).value == "expired"
            assert await q.refresh_counts() == 0
    asyncio.run(scenario())
