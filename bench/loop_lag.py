"""How late the load generator's own event loop ran during a run: if it fell behind, arrivals came in bursts
and latencies include the client's delay, so each benchmark reports it beside its figures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
TICK_S = 0.01
LAG_WARNING_S = 0.1


async def with_loop_lag(work: Awaitable[T]) -> tuple[T, float]:
    """`work`'s result and the longest delay (s) past a 10 ms sleep seen on this event loop meanwhile."""
    worst = 0.0

    async def probe() -> None:
        nonlocal worst
        while True:
            started = time.perf_counter()
            await asyncio.sleep(TICK_S)
            worst = max(worst, time.perf_counter() - started - TICK_S)

    task = asyncio.create_task(probe())
    try:
        return await work, worst
    finally:
        task.cancel()


def describe_lag(worst_s: float) -> str:
    if worst_s <= LAG_WARNING_S:
        return f"the load generator kept time (its event loop was at most {worst_s * 1000:.0f} ms late)"
    return (f"WARNING: the load generator's event loop was up to {worst_s * 1000:.0f} ms late; arrivals were "
            "burstier than planned and latencies include the client's delay (is the machine busy?)")
