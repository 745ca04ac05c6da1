"""Strategies that estimate each engine's time to a request's first token from its pending prefill, its measured
prefill rate and the prompt's uncached tokens: the lowest estimate (after Dynamo's KV router), and cache affinity
bounded by that estimate."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, SaturationPolicy, available, typical_rate


def near_best(estimates: Sequence[float], candidates: Sequence[EndpointSnapshot], tolerance: float, floor_s: float,
              rng: random.Random) -> EndpointSnapshot:
    """One of the candidates whose estimate is within tolerance (relative) or floor_s of the lowest, at random:
    replicas reading the same scrape do not all pick the same engine."""
    best = min(estimates)
    limit = max(best * (1.0 + tolerance), best + floor_s)
    near = [e for t, e in zip(estimates, candidates, strict=True) if t <= limit]
    return near[0] if len(near) == 1 else rng.choice(near)


@dataclass(frozen=True)
class EstimatedTTFT:
    """After Dynamo's KV router: each available engine's estimated time to this request's first token, the prompt
    tokens it must compute first (its pending prefill, this gateway's dispatches it has not reported yet, and this
    request's tokens not in its prefix cache) over the rate it computes them, plus the wait for a batch slot when its
    batch is full (its decode load); the lowest wins. Engines within
    tie_tolerance of the best are equals, one taken at random: replicas reading the same scrape do not all pick the
    same one (with two near-equal engines, the better of two random choices would)."""

    policy: SaturationPolicy = SaturationPolicy()
    default_rate: float = 2000.0  # tokens/s for an engine that has not measured its own (vLLM pods, new engines)
    tie_tolerance: float = 0.1  # relative
    tie_floor_s: float = 0.0005  # estimates this close are a tie whatever their ratio

    same_hardware: float = 1.5  # measured rates within this factor of the fleet's median are taken as the median

    def estimate(self, e: EndpointSnapshot, request: RoutingContext, typical_rate: float | None = None) -> float:
        """Seconds of prefill ahead of this request's first token on e. An engine's own rate is used only where it
        differs from the fleet's typical (median) one by more than `same_hardware`: a rate measured over a few
        steps is noisy, and it feeds back (an engine measured fast gets more requests, so bigger batches, which
        measure faster), herding a burst onto it; engines on other hardware differ by more than that."""
        uncached = request.num_tokens * (1.0 - request.prefix_matches.get(e.url, 0.0))
        rate = typical_rate or self.default_rate
        if e.prefill_rate and not 1 / self.same_hardware <= e.prefill_rate / rate <= self.same_hardware:
            rate = e.prefill_rate
        return (e.prefill_tokens_pending + e.in_flight_tokens + uncached) / rate + self.slot_wait(e)

    @staticmethod
    def slot_wait(e: EndpointSnapshot) -> float:
        """The decode load: with its batch full, a request waits for a slot; with c slots each held for s seconds
        one frees every s / c seconds, and the k-th request past the full batch waits k of those."""
        if not e.max_num_seqs or not e.slot_seconds:
            return 0.0
        beyond = e.num_running + e.num_waiting + e.in_flight - e.max_num_seqs + 1
        return max(0, beyond) * e.slot_seconds / e.max_num_seqs

    def choose(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
               rng: random.Random) -> EndpointSnapshot | None:
        candidates = available(endpoints, self.policy)
        if not candidates:
            return None
        typical = typical_rate(endpoints)
        estimates = [self.estimate(e, request, typical) for e in candidates]
        return near_best(estimates, candidates, self.tie_tolerance, self.tie_floor_s, rng)


@dataclass(frozen=True)
class PrefixAffinity:
    """Cache affinity with a bounded cost: a request goes to the engine that holds most of its prompt (at least
    min_match of it) unless waiting there would cost more than `stickiness` times the prefill the hit saves; a
    prompt no engine holds goes to the lowest estimated time to first token. Moving a tenant costs more than its one
    miss: its prefix is computed again and evicts other tenants' (the greedy lowest-TTFT choice, stickiness 1, loses
    half its hit rate when KV capacity binds), so a holder keeps its tenants until it is really behind, and never
    while it is saturated and another engine is not (the saturation filter comes first, as in the Inference
    Extension's scheduler). Released from the queue (must) with every engine saturated, all are candidates: the cache
    still decides."""

    policy: SaturationPolicy = SaturationPolicy()
    min_match: float = 0.3
    stickiness: float = 8.0
    ttft: EstimatedTTFT = EstimatedTTFT()

    def choose(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
               rng: random.Random) -> EndpointSnapshot | None:
        candidates = available(endpoints, self.policy)
        if not candidates:
            if not request.must:
                return None  # the whole pool is saturated: the request waits in the gateway's queue
            candidates = [e for e in endpoints if e.healthy]
        if not candidates:
            return None
        typical = typical_rate(endpoints) or self.ttft.default_rate
        estimates = [self.ttft.estimate(e, request, typical) for e in candidates]
        matches = [request.prefix_matches.get(e.url, 0.0) for e in candidates]
        top = max(matches)
        if top >= self.min_match:
            holder = min((k for k, m in enumerate(matches) if m == top), key=lambda k: (estimates[k], rng.random()))
            saved_s = request.num_tokens * top / typical
            if estimates[holder] - min(estimates) <= self.stickiness * saved_s:
                return candidates[holder]
        return near_best(estimates, candidates, self.ttft.tie_tolerance, self.ttft.tie_floor_s, rng)
