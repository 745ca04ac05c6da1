"""Which engine serves a request: pure decisions over endpoint snapshots (after the Inference Extension's picker).

Unhealthy and saturated endpoints are dropped; the rest are scored by KV headroom, queue depth and prefix
affinity with configurable weights; ties between the best are broken by two random choices so that several
gateway replicas do not herd onto one pod. Round-robin and least-request stay selectable for comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EndpointSnapshot:
    """What the gateway knows of one engine at the moment of routing."""

    url: str
    healthy: bool
    kv_cache_usage: float  # 0-1, from the engine's /metrics
    num_waiting: int  # from /metrics
    num_running: int  # from /metrics
    metrics_age_s: float  # time since the last successful scrape
    in_flight: int = 0  # requests this gateway sent that the scrape does not show yet (endpoints.unseen)
    max_num_seqs: int | None = None  # the engine's batch capacity, when it exports it

    @property
    def queue_depth(self) -> int:
        """Waiting requests as the engine will see them: the scraped queue plus this gateway's dispatches it did
        not show yet, less those that fit in the engine's free batch slots (when it says how many it has)."""
        if self.max_num_seqs is None:
            return self.num_waiting + self.in_flight
        free_slots = max(0, self.max_num_seqs - self.num_running)
        return self.num_waiting + max(0, self.in_flight - free_slots)

    @property
    def occupancy(self) -> float | None:
        """Requests held (running, waiting, just sent) over the batch capacity; None when capacity is unknown."""
        if not self.max_num_seqs:
            return None
        return (self.num_running + self.num_waiting + self.in_flight) / self.max_num_seqs


@dataclass(frozen=True)
class SaturationPolicy:
    """The Inference Extension's defaults: queue >= 5 or KV >= 0.8 or metrics older than 200 ms."""

    max_queue: int = 5
    max_kv_usage: float = 0.8
    max_metrics_age_s: float = 0.2

    def is_saturated(self, e: EndpointSnapshot) -> bool:
        return (e.queue_depth >= self.max_queue or e.kv_cache_usage >= self.max_kv_usage
                or e.metrics_age_s > self.max_metrics_age_s)


@dataclass(frozen=True)
class ScoreWeights:
    queue: float = 2.0
    kv: float = 2.0
    prefix: float = 3.0


def score(e: EndpointSnapshot, prefix_match: float, weights: ScoreWeights, policy: SaturationPolicy) -> float:
    """Higher is better: KV headroom, a short queue, and the share of the prompt's prefix likely cached there.
    Where the engine exports its batch capacity, queue room is measured against capacity plus the queue limit,
    so a busy one-slot engine does not look as free as an idle eight-slot one."""
    if e.max_num_seqs:
        held = e.num_running + e.num_waiting + e.in_flight
        queue_room = max(0.0, 1.0 - held / (e.max_num_seqs + policy.max_queue))
    else:
        queue_room = max(0.0, 1.0 - e.queue_depth / policy.max_queue)
    kv_room = max(0.0, 1.0 - e.kv_cache_usage)
    return weights.queue * queue_room + weights.kv * kv_room + weights.prefix * prefix_match


def available(endpoints: list[EndpointSnapshot], policy: SaturationPolicy) -> list[EndpointSnapshot]:
    """Healthy endpoints that are not saturated; empty means the request should wait in the queue."""
    return [e for e in endpoints if e.healthy and not policy.is_saturated(e)]


def pick_by_score(endpoints: list[EndpointSnapshot], prefix_matches: dict[str, float], rng: random.Random,
                  weights: ScoreWeights = ScoreWeights(), policy: SaturationPolicy = SaturationPolicy(),
                  tie_tolerance: float = 0.05) -> EndpointSnapshot | None:
    """The best available endpoint; among those within tie_tolerance of the best, the better of two random ones."""
    candidates = available(endpoints, policy)
    if not candidates:
        return None
    scored = [(score(e, prefix_matches.get(e.url, 0.0), weights, policy), e) for e in candidates]
    best = max(s for s, _ in scored)
    near = [(s, e) for s, e in scored if s >= best - tie_tolerance]
    if len(near) == 1:
        return near[0][1]
    first, second = rng.sample(near, 2)
    return first[1] if first[0] >= second[0] else second[1]


def pick_least_request(endpoints: list[EndpointSnapshot], rng: random.Random,
                       policy: SaturationPolicy = SaturationPolicy()) -> EndpointSnapshot | None:
    candidates = available(endpoints, policy)
    if not candidates:
        return None
    fewest = min(e.num_running + e.queue_depth for e in candidates)
    return rng.choice([e for e in candidates if e.num_running + e.queue_depth == fewest])


def pick_round_robin(endpoints: list[EndpointSnapshot], counter: int) -> EndpointSnapshot | None:
    """Plain rotation over healthy endpoints, blind to load (the baseline kvfleet is compared against)."""
    healthy = [e for e in endpoints if e.healthy]
    return healthy[counter % len(healthy)] if healthy else None


def pick(strategy: str, endpoints: list[EndpointSnapshot], prefix_matches: dict[str, float], rng: random.Random,
         counter: int, weights: ScoreWeights = ScoreWeights(), policy: SaturationPolicy = SaturationPolicy(),
         exclude: frozenset[str] = frozenset(), must: bool = False) -> EndpointSnapshot | None:
    """The configured strategy over the endpoints not excluded. With must (a request released from the queue,
    or a retry), a healthy endpoint is returned even when all are saturated: the least loaded one."""
    endpoints = [e for e in endpoints if e.url not in exclude]
    if strategy == "round-robin":
        chosen = pick_round_robin(endpoints, counter)
    elif strategy == "least-request":
        chosen = pick_least_request(endpoints, rng, policy)
    else:
        chosen = pick_by_score(endpoints, prefix_matches, rng, weights, policy)
    if chosen is None and must:
        healthy = [e for e in endpoints if e.healthy]
        if healthy:
            chosen = min(healthy, key=lambda e: (e.queue_depth, e.kv_cache_usage, rng.random()))
    return chosen


def free_slots(endpoints: list[EndpointSnapshot], policy: SaturationPolicy = SaturationPolicy()) -> int:
    """How many queued requests the fleet can take now: each available endpoint's free batch slots (when known)
    and its room below the queue limit."""
    total = 0
    for e in available(endpoints, policy):
        free_batch = max(0, e.max_num_seqs - e.num_running - e.in_flight) if e.max_num_seqs else 0
        total += max(1, free_batch + policy.max_queue - e.queue_depth)
    return total
