"""Leases on the fleet queue's released entries, on a real Redis shared by two replicas (two FleetQueue objects): an
entry one replica releases to another is leased to its owner until the owner has the grant, so a grant whose message
never arrives is still served, once, and leases never outlive their owner."""

from __future__ import annotations

import asyncio
import time

import redis

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.redis_keys import queue_entries_key, queue_key, queue_leases_key
from kvfleet.gateway.queue.fleet import FleetQueue, Outcome, now_ms
from tests.support.queues import replica, running

S = Priority.STANDARD


def leases(url: str, fleet: str = "f") -> dict[str, str]:
    return redis.Redis.from_url(url, decode_responses=True).hgetall(queue_leases_key(fleet))


async def until(condition, message: str, timeout: float = 10.0) -> float:
    """Polls until condition() holds; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(message)
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def stop_tasks(queue: FleetQueue, *names: str) -> None:
    """Ends the replica's background tasks by name (a cancel can be lost inside redis-py's reads: asked until done)."""
    tasks = [t for t in queue._tasks if t.get_name() in names]
    assert len(tasks) == len(names), queue._tasks

    def stopped() -> bool:
        for task in tasks:
            task.cancel()
        return all(t.done() for t in tasks)
    await until(stopped, f"{names} did not stop")


async def stop_listening(queue: FleetQueue) -> None:
    """Its grants channel goes deaf (a subscription reconnecting, a Redis hiccup): messages on it are lost."""
    await stop_tasks(queue, "queue grants")


def test_a_grant_whose_message_is_lost_reaches_its_owner_through_the_lease_once(redis_server) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        a.release_window_ms = 1
        async with running(a, b):
            await stop_listening(b)
            entry = await b.enqueue(S, 30_000)
            waiting = asyncio.ensure_future(b.wait(entry))
            assert await a.release(1) == [(entry.id, "b")]  # its message on b's channel is lost
            lease = leases(redis_server.url).get(entry.id)
            assert waiting.done() or lease.startswith("b|"), lease  # (unless b's reconcile took it just now)
            took = await until(waiting.done, "the released entry never reached its owner")
            assert waiting.result() is Outcome.GRANTED
            print(f"a lost grant reached its owner through its lease after {took:.2f} s")
            assert leases(redis_server.url) == {}  # acknowledged
            for _ in range(2):  # "missing twice" in b's reconcile: it is not queued again, nor released twice
                await b._reconcile()
            store = redis.Redis.from_url(redis_server.url)
            assert store.zcard(queue_key("f")) == 0 and store.hlen(queue_entries_key("f")) == 0
            assert await a.release(5) == []
    asyncio.run(scenario())


def test_a_grant_that_arrives_acknowledges_its_lease(redis_server) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        async with running(a, b):
            store = redis.Redis.from_url(redis_server.url)
            await until(lambda: store.pubsub_numsub(b.redis.grants_channel)[0][1] == 1, "b never subscribed")
            entry = await b.enqueue(S, 30_000)
            waiting = asyncio.ensure_future(b.wait(entry))
            await a.release(1)
            assert await asyncio.wait_for(waiting, 5) is Outcome.GRANTED
            # acknowledged on arrival: a lease b did not acknowledge would stay until swept (8 s)
            await until(lambda: leases(redis_server.url) == {}, "the lease stayed after its grant arrived", 4)
    asyncio.run(scenario())


def test_the_leases_of_a_replica_that_died_are_swept(redis_server) -> None:
    async def scenario() -> None:
        dead = replica(redis_server.url, "dead", heartbeat_ms=2000)
        live = replica(redis_server.url, "live")
        await dead.start()  # never stopped: it dies
        async with running(live):
            entry = await dead.enqueue(S, 60_000)
            await stop_tasks(dead, "queue grants", "queue maintenance")  # it dies: no heartbeats, no grants taken
            assert await live.release(1) == [(entry.id, "dead")]  # before its heartbeat ran out
            assert list(leases(redis_server.url)) == [entry.id]
            took = await until(lambda: leases(redis_server.url) == {}, "a dead replica's lease stayed")
            print(f"a dead replica's lease was swept {took:.2f} s after its release")
            await dead.client.aclose()
    asyncio.run(scenario())


def test_a_lease_its_live_owner_never_takes_is_swept_once_long_expired(redis_server) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        async with running(a, b):
            await b.enqueue(S, 30_000)
            await stop_tasks(b, "queue grants", "queue maintenance")  # b hangs: no grants taken, heartbeat alive
            await a.release(1)
            expires = now_ms() + b.heartbeat_ms + a.redis.grace_ms
            assert await a.redis.sweep_leases(expires - 1000, b.heartbeat_ms) == 0  # its owner is alive
            assert len(leases(redis_server.url)) == 1
            assert await a.redis.sweep_leases(expires + 1000, b.heartbeat_ms) == 1
            assert leases(redis_server.url) == {}
    asyncio.run(scenario())


def test_an_entry_released_to_a_replica_while_it_queued_in_process_is_granted_when_it_moves_back(redis_server) -> None:
    """Redis unreachable from b alone: b queues in-process while a, which still sees b's heartbeat, releases b's entry
    in Redis. When b hands its entries back, the lease says that one's turn came: granted, not queued again."""
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        a.release_window_ms = 1
        async with running(a, b):
            entry = await b.enqueue(S, 30_000)
            await stop_tasks(b, "queue maintenance", "queue grants")  # b moves back when this test says so, and
            # hears nothing on its channel meanwhile (a replica cut off from Redis would not)
            await b._degrade(ConnectionError("b cannot reach Redis"))
            waiting = asyncio.ensure_future(b.wait(entry))
            assert await a.release(1) == [(entry.id, "b")]
            await asyncio.sleep(0.3)
            assert not waiting.done()  # b heard nothing: it is not listening while degraded
            await b._try_restore()
            assert b.using_redis
            assert await asyncio.wait_for(waiting, 5.0) is Outcome.GRANTED
            assert entry.id not in leases(redis_server.url)
            store = redis.Redis.from_url(redis_server.url)
            assert store.zcard(queue_key("f")) == 0 and store.hlen(queue_entries_key("f")) == 0  # not queued again
    asyncio.run(scenario())
