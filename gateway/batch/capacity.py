"""How much batch work the fleet may take now (pure): only what interactive traffic leaves.

Batch requests are sent only while no interactive request waits in the fleet queue, and only to engines that are
not saturated, up to each engine's free batch slots less a reserve kept for interactive arrivals: as interactive
load rises, the free slots shrink and batch work stops being sent (the fleet-wide in-flight cap is the sum, and it
shrinks with the load, recomputed on every decision). Batch requests also carry the lowest engine priority, so an
interactive request that reaches an engine full of batch work preempts one at the next step (kvfleet's engine, and
vLLM with --scheduling-policy priority): an interactive burst waits at most one decode step behind batch work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.gateway.batch.settings import DEFAULT_SHARE
from kvfleet.gateway.routing.pick import EndpointSnapshot, SaturationPolicy


@dataclass(frozen=True)
class BatchRoom:
    """The share of each engine's batch slots batch work may hold, and the slots kept free for interactive work."""

    reserve_fraction: float = 0.25  # of an engine's batch slots, never given to batch work
    min_reserve: int = 1
    unknown_capacity_slots: int = 1  # batch requests an engine may hold when it does not say its batch size
    # the most of an engine's batch slots batch work holds at once: where a step's time grows with its batch (CPUs;
    # GPUs far less), every batch sequence slows the interactive ones beside it (docs/benchmarks.md, "Batch API":
    # on 2 CPU cores 0.5 took 0.93x the idle capacity at 2.5x the interactive p99 TTFT, 0.25 0.75x at 1.65x)
    share: float = DEFAULT_SHARE

    def reserve(self, max_num_seqs: int) -> int:
        return max(self.min_reserve, math.ceil(max_num_seqs * self.reserve_fraction))

    def room(self, e: EndpointSnapshot, batch_in_flight: int) -> int:
        """Batch requests engine `e` may take now beyond the `batch_in_flight` it holds."""
        if e.max_num_seqs is None:
            return max(0, self.unknown_capacity_slots - batch_in_flight)
        held = e.num_running + e.num_waiting + e.in_flight
        free = e.max_num_seqs - self.reserve(e.max_num_seqs) - max(held, batch_in_flight)
        return max(0, min(free, math.floor(e.max_num_seqs * self.share) - batch_in_flight))


def batch_targets(endpoints: Sequence[EndpointSnapshot], interactive_queued: int, batch_in_flight: dict[str, int],
                  policy: SaturationPolicy, room: BatchRoom = BatchRoom()) -> dict[str, int]:
    """Engine url -> batch requests it may take now; empty while interactive requests wait or none has room."""
    if interactive_queued > 0:
        return {}
    out = {}
    for e in endpoints:
        if not e.healthy or policy.is_saturated(e):
            continue
        free = room.room(e, batch_in_flight.get(e.url, 0))
        if free > 0:
            out[e.url] = free
    return out
