"""Fleet-queue replicas on a real Redis (or in-process), started and stopped around a test, and releases driven by
hand."""

from __future__ import annotations

import asyncio
import contextlib

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.fleet import FleetQueue, Outcome
from kvfleet.gateway.queue.order import QueueEntry

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE
CAPS = {C: 500, S: 500, X: 500}


def replica(url: str | None, name: str, policy: str = "fair", aging_ms: float = 10_000.0, fleet: str = "f",
            caps: dict | None = None, heartbeat_ms: int = 3000) -> FleetQueue:
    """One gateway replica's fleet queue (`url` None: in-process only)."""
    return FleetQueue(url, fleet, name, aging_ms, caps or CAPS, heartbeat_ms=heartbeat_ms, policy=policy)


@contextlib.asynccontextmanager
async def running(*queues: FleetQueue):
    """The replicas started, and stopped however the test ends."""
    for queue in queues:
        await queue.start()
    try:
        yield
    finally:
        for queue in queues:
            await queue.stop()


async def release_all(queues: list[FleetQueue], entries: list[QueueEntry], per_release: int = 1,
                      every_s: float = 0.002) -> list[str]:
    """Releases everything, `per_release` at a time every `every_s` (past the release window), by each replica in
    turn; the ids in the order released. Every owner's wait ends granted (other replicas' entries reach their owner
    on its grants channel)."""
    owner = {e.id: q for q in queues for e in entries if e.owner == q.gateway_id}
    waiting = asyncio.gather(*(owner[e.id].wait(e) for e in entries))
    order: list[str] = []
    turn = 0
    while len(order) < len(entries):
        for queue in queues:
            queue.release_window_ms = 1
        order += [entry_id for entry_id, _ in await queues[turn % len(queues)].release(per_release)]
        turn += 1
        await asyncio.sleep(every_s)
    assert await asyncio.wait_for(waiting, 5.0) == [Outcome.GRANTED] * len(entries)
    return order
