"""Routing signals, one class per signal (after llm-d's scorer plugins): each scores the candidate engines in [0, 1].

A new signal is a new class here plus its weight in a strategy; the picker in pick.py combines them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext


class Scorer(Protocol):
    """One signal: a score in [0, 1] per candidate, in the candidates' order; higher is better."""

    def scores(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext) -> list[float]: ...


@dataclass(frozen=True)
class QueueRoom:
    """Room left in an engine's queue. Where the engine exports its batch capacity, room is measured against capacity
    plus the queue limit, so a busy one-slot engine does not look as free as an idle eight-slot one."""

    max_queue: int

    def scores(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext) -> list[float]:
        return [self.room(e) for e in endpoints]

    def room(self, e: EndpointSnapshot) -> float:
        if e.max_num_seqs:
            held = e.num_running + e.num_waiting + e.in_flight
            return max(0.0, 1.0 - held / (e.max_num_seqs + self.max_queue))
        return max(0.0, 1.0 - e.queue_depth / self.max_queue)


@dataclass(frozen=True)
class KVHeadroom:
    """The share of an engine's KV cache still free."""

    def scores(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext) -> list[float]:
        return [max(0.0, 1.0 - e.kv_cache_usage) for e in endpoints]


@dataclass(frozen=True)
class PrefixMatch:
    """The share of the prompt's leading blocks likely in an engine's prefix cache (gateway/prefix/approximate.py)."""

    def scores(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext) -> list[float]:
        return [request.prefix_matches.get(e.url, 0.0) for e in endpoints]
