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
class LoraAffinity:
    """Where a request's adapter runs best, as the Gateway API Inference Extension's lora-affinity scorer scores it:
    1 where the adapter is active (its requests run there, or this gateway just sent one), 0.8 where the engine has
    a free adapter slot, 0.6 where it only waits there, 0 where the engine is full of other adapters or does not
    serve it. One step kvfleet adds: among engines with a free slot, 0.9 for the one its latest request went to (its
    weights likely still read there, in host memory or a slot), so an idle adapter returns where it was.
    Requests of the base model score 0 everywhere: a signal alike for every candidate must add nothing to the totals,
    since adding a constant moves sums across the tie tolerance by rounding (0.95 and 0.9 are 0.05 apart; 3.95 and
    3.9 are not, in floating point) and so would change which engines count as tied."""

    def scores(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext) -> list[float]:
        if request.adapter is None:
            return [0.0] * len(endpoints)
        return [self.score(e, request.adapter) for e in endpoints]

    @staticmethod
    def score(e: EndpointSnapshot, adapter: str) -> float:
        if e.lora is None or (e.adapters_served is not None and adapter not in e.adapters_served):
            return 0.0
        if adapter in e.lora.running or adapter in e.adapters_sent:
            return 1.0
        if len(e.lora.running | e.lora.waiting | e.adapters_sent) < e.lora.max_loras:
            return 0.9 if adapter in e.adapters_last else 0.8
        return 0.6 if adapter in e.lora.waiting else 0.0


@dataclass(frozen=True)
class PrefixMatch:
    """The share of the prompt's leading blocks likely in an engine's prefix cache (gateway/prefix/approximate.py)."""

    def scores(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext) -> list[float]:
        return [request.prefix_matches.get(e.url, 0.0) for e in endpoints]
