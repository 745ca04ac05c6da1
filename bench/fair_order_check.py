"""The fair order across gateway replicas (issue 16's last target): one deterministic script of enqueues (several
tenants, weights via charges, bursts) and partial releases runs through two `FleetQueue`s sharing a real Redis
(alternating which one acts), through one, and through the in-process policy; each order's position displacement
against the one-queue order, as % of N. Run by bench/noisy_neighbour.py (its order phase, or `--order-only`)."""

from __future__ import annotations

import asyncio
import random

from kvfleet.fleet.priority import Priority
from kvfleet.local.redis_server import RedisServer


def order_displacement(reference: list, other: list) -> dict:
    """How far each item of `reference` moved in `other`: mean and max |position change| as % of N, and the items
    missing from `other` (counted as moved to the end)."""
    n = len(reference)
    if n == 0:
        return {"n": 0, "mean_pct": 0.0, "max_pct": 0.0, "missing": 0}
    where = {item: i for i, item in enumerate(other)}
    moves = [abs(where.get(item, n) - i) for i, item in enumerate(reference)]
    return {"n": n, "mean_pct": 100.0 * sum(moves) / n / n, "max_pct": 100.0 * max(moves) / n,
            "missing": sum(item not in where for item in reference)}



ORDER_TENANTS = {"t0": 1.0, "t1": 1.0, "t2": 2.0, "t3": 0.5, "t4": 4.0}  # tenant -> weight


def order_script(seed: int = 0, steps: int = 60) -> list[tuple[str, object]]:
    """Deterministic steps: ("enqueue", (tenant, charge)) in bursts, and ("release", n) now and then; then the rest."""
    rng, script = random.Random(seed), []
    for _ in range(steps):
        tenant = rng.choice(sorted(ORDER_TENANTS))
        for _ in range(rng.randint(1, 8)):
            script.append(("enqueue", (tenant, rng.choice((50.0, 100.0, 400.0)) / ORDER_TENANTS[tenant])))
        if rng.random() < 0.4:
            script.append(("release", rng.randint(1, 6)))
    return script + [("release", 1 << 20)]


async def fleet_queue_order(redis_url: str, fleet: str, replicas: int, script: list) -> list[int]:
    """The script through `replicas` FleetQueues sharing Redis, alternating which one acts; script indices in
    release order."""
    from kvfleet.gateway.queue.fleet import FleetQueue

    caps = {p: 1 << 30 for p in Priority}
    queues = [FleetQueue(redis_url, fleet, f"{fleet}-r{i}", aging_ms=10_000.0, caps=caps) for i in range(replicas)]
    for q in queues:
        q.release_window_ms = 0  # one caller releasing in turn: nothing to hold back for other replicas
        await q.start()
    order, index_of = [], {}
    try:
        for step, (op, arg) in enumerate(script):
            queue = queues[step % replicas]
            if op == "enqueue":
                entry = await queue.enqueue(Priority.STANDARD, 600_000, tenant=arg[0], charge=arg[1])
                index_of[entry.id] = step
            else:
                order += [index_of[entry_id] for entry_id, _ in await queue.release(arg)]
    finally:
        for q in queues:
            await q.stop()
    return order


def in_process_order(script: list) -> list[int]:
    """The same script through the in-process policy (fair_order.py), which the Redis scripts mirror."""
    from kvfleet.gateway.queue.local import LocalQueue
    from kvfleet.gateway.queue.order import QueueEntry

    queue, order = LocalQueue("fair"), []
    for step, (op, arg) in enumerate(script):
        if op == "enqueue":
            queue.enqueue(QueueEntry(str(step), Priority.STANDARD, float(step), 600_000.0 + step, "me", *arg), None)
        else:
            order += [int(e.id) for e in queue.release(arg)]
    return order


def order_phase(redis_url: str | None, seed: int) -> dict:
    script = order_script(seed)
    server = RedisServer().start() if redis_url is None else None
    url = redis_url or server.url
    try:
        two = asyncio.run(fleet_queue_order(url, f"order-2-{seed}", 2, script))
        one = asyncio.run(fleet_queue_order(url, f"order-1-{seed}", 1, script))
    finally:
        if server is not None:
            server.stop()
    return {"n": len(one), "two_replicas_vs_one": order_displacement(one, two),
            "in_process_vs_one": order_displacement(one, in_process_order(script))}
