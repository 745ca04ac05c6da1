"""The fleet-wide priority queue on a real Redis server shared by two gateway replicas (two FleetQueue objects),
and its in-process fallback while Redis is away. No engines: capacity is whatever the test releases."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.redis_keys import queue_key
from kvfleet.gateway.queue.fleet import FleetQueue, Outcome
from tests.support.queues import replica, running

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


async def until(condition, timeout: float = 5.0) -> None:
    """Until condition() holds, on this event loop (the queue's tasks run meanwhile); AssertionError after timeout."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def wait_all(queue: FleetQueue, entries, order: list[str]) -> list[Outcome]:
    async def one(entry):
        outcome = await queue.wait(entry)
        order.append(entry.id)
        return outcome
    return await asyncio.gather(*(one(e) for e in entries))


def test_strict_priority_and_fcfs_across_two_replicas_sharing_one_redis(redis_server) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        async with running(a, b):
            plan = [(a, S), (b, S), (a, C), (b, X), (a, S), (b, C), (a, C)]
            entries = []
            for q, p in plan:
                entries.append((q, await q.enqueue(p, 30_000)))
                await asyncio.sleep(0.002)  # distinct arrival times
            assert redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 7  # the operator's key
            await a.refresh_counts()
            assert a.counts() == {C: 3, S: 3, X: 1}
            order: list[str] = []
            waiters = asyncio.gather(wait_all(a, [e for q, e in entries if q is a], order),
                                     wait_all(b, [e for q, e in entries if q is b], order))
            for i in range(7):  # room for one at a time, seen alternately by either replica after each scrape
                for _ in range(100):
                    if len(order) == i + 1:
                        break
                    await (a if i % 2 else b).release(1)  # a no-op within the window of the last release
                    await asyncio.sleep(0.02)
            outcomes = await waiters
            assert all(o is Outcome.GRANTED for group in outcomes for o in group)
            expected = [e.id for _, e in sorted(entries, key=lambda qe: qe[1].score)]
            assert order == expected
            assert [e.priority for _, e in sorted(entries, key=lambda qe: qe[1].score)] == [C, C, C, S, S, S, X]
            assert await a.refresh_counts() == 0
    asyncio.run(scenario())


def test_replicas_that_see_the_same_room_release_it_once_between_them(redis_server) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        a.release_window_ms = b.release_window_ms = 300
        async with running(a, b):
            for q in (a, b, a, b):
                await q.enqueue(S, 30_000)
            first = await a.release(2)  # both saw room for 2 at their last scrape
            second = await b.release(2)
            assert len(first) == 2 and second == []
            await asyncio.sleep(0.35)  # the next scrape interval: room is fresh again
            assert len(await b.release(2)) == 2
    asyncio.run(scenario())


def test_a_long_waiting_request_overtakes_fresh_critical_ones_after_the_aging_window(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "a", aging_ms=200)
        async with running(q):
            old = await q.enqueue(S, 30_000)
            await asyncio.sleep(0.3)
            fresh = await q.enqueue(C, 30_000)
            order: list[str] = []
            task = asyncio.ensure_future(wait_all(q, [old, fresh], order))
            await q.release(1)
            await until(lambda: order)
            assert order == [old.id]
            await asyncio.sleep(q.release_window_ms / 1000)  # a release within the window counts the first one's room
            await q.release(1)
            assert await asyncio.wait_for(task, 5) == [Outcome.GRANTED, Outcome.GRANTED]
            assert order == [old.id, fresh.id]
    asyncio.run(scenario())


def test_the_deadline_ends_the_wait_and_removes_the_entry(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "a")
        async with running(q):
            entry = await q.enqueue(S, 150)
            outcome = await q.wait(entry)
            assert outcome is Outcome.EXPIRED
            assert await q.refresh_counts() == 0
            assert redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 0
    asyncio.run(scenario())


def test_a_wait_cancelled_when_its_client_leaves_takes_its_entry_out_of_the_queue_at_once(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "a")
        async with running(q):
            entry = await q.enqueue(C, 30_000)
            task = asyncio.ensure_future(q.wait(entry))
            await asyncio.sleep(0)  # the wait has begun
            assert redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 1
            task.cancel()  # what a front does when its client's connection closes
            with pytest.raises(asyncio.CancelledError):
                await task
            assert redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 0
            assert q.total() == 0 and not q._waiters
    asyncio.run(scenario())


def test_per_class_caps_are_fleet_wide(redis_server) -> None:
    async def scenario() -> None:
        caps = {C: 5, S: 2, X: 0}
        a, b = replica(redis_server.url, "a", caps=caps), replica(redis_server.url, "b", caps=caps)
        async with running(a, b):
            assert await a.enqueue(S, 30_000) is not None
            assert await b.enqueue(S, 30_000) is not None
            assert await a.enqueue(S, 30_000) is None  # the fleet's standard queue is full
            assert await b.enqueue(X, 30_000) is None
            assert await b.enqueue(C, 30_000) is not None
    asyncio.run(scenario())


def test_entries_of_a_replica_that_died_expire_and_do_not_block_the_queue(redis_server) -> None:
    async def scenario() -> None:
        dead = replica(redis_server.url, "dead", heartbeat_ms=300)
        live = replica(redis_server.url, "live")
        await dead.start()  # never stopped: it dies
        async with running(live):
            for _ in range(3):
                await dead.enqueue(C, 60_000)
            for task in dead._tasks:  # the replica's process dies: no more heartbeats, nothing cleaned up
                task.cancel()
            survivor = await live.enqueue(S, 60_000)
            await asyncio.sleep(0.4)  # its heartbeat key expired
            order: list[str] = []
            waiting = asyncio.ensure_future(wait_all(live, [survivor], order))
            released = await live.release(1)  # the dead replica's critical entries are dropped on the way
            assert [owner for _, owner in released] == ["live"]
            await waiting
            assert order == [survivor.id]
            assert await live.refresh_counts() == 0
            if dead.client is not None:
                await dead.client.aclose()
    asyncio.run(scenario())


def test_a_periodic_sweep_drops_a_dead_replicas_entries_even_without_capacity(redis_server) -> None:
    async def scenario() -> None:
        dead = replica(redis_server.url, "dead", heartbeat_ms=300)
        live = replica(redis_server.url, "live")
        await dead.start()  # never stopped: it dies
        async with running(live):
            await dead.enqueue(S, 60_000)
            for task in dead._tasks:
                task.cancel()
            # the live replica sweeps every other second
            await until(lambda: redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 0, timeout=10)
            await dead.client.aclose()
    asyncio.run(scenario())


def test_when_redis_dies_the_replica_queues_in_process_and_moves_back_when_it_returns(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "a")
        async with running(q):
            assert q.backend == "redis"
            first = await q.enqueue(S, 60_000)
            redis_server.stop()
            second = await q.enqueue(C, 60_000)  # Redis is gone: this fails over, keeping both entries
            assert q.backend == "local" and "Redis unreachable" in q.redis_error
            assert q.counts() == {C: 1, S: 1, X: 0}
            order: list[str] = []
            task = asyncio.ensure_future(wait_all(q, [first, second], order))
            await q.release(1)
            await until(lambda: order)
            assert order == [second.id]  # same policy in-process: critical first
            third = await q.enqueue(S, 60_000)
            redis_server.start()  # back, empty (no persistence)
            for _ in range(50):
                if q.backend == "redis":
                    break
                await asyncio.sleep(0.1)
            assert q.backend == "redis" and q.redis_error is None
            assert redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 2  # handed back to Redis
            task2 = asyncio.ensure_future(wait_all(q, [third], order))
            await q.release(2)
            await asyncio.wait_for(asyncio.gather(task, task2), 2.0)
            assert order == [second.id, first.id, third.id]
    asyncio.run(scenario())


def test_entries_redis_lost_in_a_quick_restart_are_put_back(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "a")
        async with running(q):
            entry = await q.enqueue(S, 60_000)
            redis.Redis.from_url(redis_server.url).flushall()  # as if Redis restarted between two calls
            for _ in range(60):
                if redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 1:
                    break
                await asyncio.sleep(0.1)
            assert redis.Redis.from_url(redis_server.url).zcard(queue_key("f")) == 1
            order: list[str] = []
            task = asyncio.ensure_future(wait_all(q, [entry], order))
            await q.release(1)
            await asyncio.wait_for(task, 2.0)
            assert order == [entry.id]
    asyncio.run(scenario())


def test_without_redis_the_queue_is_in_process() -> None:
    async def scenario() -> None:
        q = replica(None, "solo")
        async with running(q):
            assert q.backend == "local"
            e = await q.enqueue(S, 60_000)
            task = asyncio.ensure_future(q.wait(e))
            await q.release(1)
            assert await asyncio.wait_for(task, 1.0) is Outcome.GRANTED
    asyncio.run(scenario())


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0"])
def test_a_gateway_started_without_reachable_redis_serves_from_the_in_process_queue(url: str) -> None:
    async def scenario() -> None:
        q = replica(url, "a")
        async with running(q):
            assert q.backend == "local" and "Redis unreachable" in q.redis_error
            assert await q.enqueue(S, 1000) is not None
    asyncio.run(scenario())


def test_after_redis_returns_stale_pooled_connections_do_not_knock_the_queue_back_to_local(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "a")
        async with running(q):
            await asyncio.gather(*(q.refresh_counts() for _ in range(12)))  # a pool of many connections
            redis_server.stop()
            await q.refresh_counts()
            assert q.backend == "local"
            redis_server.start()
            for _ in range(40):
                if q.backend == "redis":
                    break
                await asyncio.sleep(0.1)
            assert q.backend == "redis"
            await asyncio.gather(*(q.refresh_counts() for _ in range(12)))  # uses the pool again
            await asyncio.sleep(1.5)  # heartbeats and a reconcile on the pool
            assert q.backend == "redis"
    asyncio.run(scenario())


def test_after_a_release_the_replica_counts_what_is_left_at_once(redis_server) -> None:
    """What has_room and /ready read: a count that still held the released entry until the next scrape's refresh
    sent a request to its model's fallback on a fast CPU, though nothing was queued any more."""
    async def scenario() -> None:
        q = replica(redis_server.url, "a", fleet="fresh-counts")
        async with running(q):
            entry = await q.enqueue(S, 30_000)
            await q.refresh_counts()
            assert q.total() == 1
            waiting = asyncio.ensure_future(q.wait(entry))
            assert [owner for _, owner in await q.release(1)] == ["a"]
            assert q.total() == 0  # no refresh in between
            assert await asyncio.wait_for(waiting, 5) is Outcome.GRANTED
    asyncio.run(scenario())
