"""Which engine serves a request: pure decisions over endpoint snapshots (after llm-d's filters, scorers, picker).

The load-only strategies and the weighted scorer live here, the ones that estimate time to first token in
routing/ttft.py; routing/strategies.py registers them by name.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.fleet.load import LoraInfo
from kvfleet.gateway.routing.scorers import Scorer


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
    prefill_tokens_pending: int = 0  # prompt tokens the engine has yet to compute (kvfleet engines export it)
    prefill_rate: float | None = None  # prompt tokens per second its steps compute; None: not known
    in_flight_tokens: int = 0  # prompt tokens of this gateway's dispatches since the scrape
    slot_seconds: float | None = None  # how long a request holds one of its batch slots; None: not known
    critical_pending: int = 0  # critical requests this gateway sent that have not started there (no headers yet)
    critical_pending_tokens: int = 0  # their prompt tokens not cached there: the prefill a new critical one waits for
    scrape_interval_s: float = 0.0  # how often it is scraped (an engine slow to render its metrics, less often)
    lora: LoraInfo | None = None  # its adapter cap and active adapters, when it serves adapters
    adapters_sent: frozenset[str] = frozenset()  # adapters of this gateway's dispatches since the scrape
    adapters_served: frozenset[str] | None = None  # the adapters its /v1/models lists (None: not read yet)
    adapters_last: frozenset[str] = frozenset()  # adapters whose latest request this gateway sent here

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


STALE_SCRAPES = 2.5  # an engine's metrics are stale after this many of its scrape intervals (and max_metrics_age_s)


@dataclass(frozen=True)
class SaturationPolicy:
    """The Inference Extension's defaults: queue >= 5 or KV >= 0.8 or metrics older than 200 ms."""

    max_queue: int = 5
    max_kv_cache_usage: float = 0.8
    max_metrics_age_s: float = 0.2
    # While requests wait in the fleet queue, its releases fill an engine's free batch slots and this many waiting
    # requests beyond them: the engine's own queue is first come, first served, so the order that is fair (by tenant,
    # queue/fair_order.py) holds only while requests wait in the gateway; one waiting covers a freed slot until the next
    # scrape releases another.
    release_queue: int = 1

    def is_saturated(self, e: EndpointSnapshot) -> bool:
        return (e.queue_depth >= self.max_queue or e.kv_cache_usage >= self.max_kv_cache_usage
                or self.is_stale(e))

    def is_stale(self, e: EndpointSnapshot) -> bool:
        """Metrics older than max_metrics_age_s, or than STALE_SCRAPES of the engine's own scrape intervals where
        the gateway reads it less often (its /metrics is costly to render: gateway/engines/scraper.py)."""
        return e.metrics_age_s > max(self.max_metrics_age_s, STALE_SCRAPES * e.scrape_interval_s)


@dataclass(frozen=True)
class ScoreWeights:
    """Each signal's weight in the "kvfleet" strategy (--weight-queue, --weight-kv, --weight-prefix, --weight-lora)."""

    queue: float = 2.0
    kv: float = 2.0
    prefix: float = 3.0
    lora: float = 3.0  # adapter affinity (LoraAffinity), for requests that name an adapter


@dataclass(frozen=True)
class RoutingContext:
    """What one routing decision knows of its request besides the engines' load."""

    prefix_matches: Mapping[str, float] = field(default_factory=dict)  # engine url -> share of the prompt cached there
    exclude: frozenset[str] = frozenset()  # engines already tried for this request
    must: bool = False  # released from the queue, or a retry: the least loaded healthy engine rather than none
    turn: int = 0  # this gateway's running count of decisions (round-robin rotates on it)
    num_tokens: int = 0  # the prompt's length in tokens (estimated from its characters where not tokenized)
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)


def available(endpoints: Sequence[EndpointSnapshot], policy: SaturationPolicy) -> list[EndpointSnapshot]:
    """The saturation filter: healthy endpoints that are not saturated; empty means the request should wait."""
    return [e for e in endpoints if e.healthy and not policy.is_saturated(e)]


class Strategy(Protocol):
    """Filters, scores and picks one endpoint for a request, or None when it should wait in the queue."""

    def choose(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
               rng: random.Random) -> EndpointSnapshot | None: ...


@dataclass(frozen=True)
class WeightedScoring:
    """Available endpoints scored by weighted signals; among those within tie_tolerance of the best, the better of
    two random ones, so that several gateway replicas do not herd onto one pod."""

    scorers: tuple[tuple[float, Scorer], ...]
    policy: SaturationPolicy = SaturationPolicy()
    tie_tolerance: float = 0.05

    def choose(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
               rng: random.Random) -> EndpointSnapshot | None:
        candidates = available(endpoints, self.policy)
        if not candidates:
            return None
        totals = [0.0] * len(candidates)
        for weight, scorer in self.scorers:
            for i, value in enumerate(scorer.scores(candidates, request)):
                totals[i] += weight * value
        best = max(totals)
        near = [(s, e) for s, e in zip(totals, candidates, strict=True) if s >= best - self.tie_tolerance]
        if len(near) == 1:
            return near[0][1]
        first, second = rng.sample(near, 2)
        return first[1] if first[0] >= second[0] else second[1]


@dataclass(frozen=True)
class LeastRequest:
    """Available endpoints with the fewest outstanding requests (running, waiting, and sent since the scrape, as
    Envoy's and every load balancer's least-request counts them); a random one among equals."""

    policy: SaturationPolicy = SaturationPolicy()

    def choose(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
               rng: random.Random) -> EndpointSnapshot | None:
        candidates = available(endpoints, self.policy)
        if not candidates:
            return None
        fewest = min(outstanding(e) for e in candidates)
        return rng.choice([e for e in candidates if outstanding(e) == fewest])


def outstanding(e: EndpointSnapshot) -> int:
    return e.num_running + e.num_waiting + e.in_flight


@dataclass(frozen=True)
class RoundRobin:
    """Plain rotation over healthy endpoints, blind to load (the baseline kvfleet is compared against)."""

    def choose(self, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
               rng: random.Random) -> EndpointSnapshot | None:
        healthy = [e for e in endpoints if e.healthy]
        return healthy[request.turn % len(healthy)] if healthy else None


def critical_room(endpoints: Sequence[EndpointSnapshot], policy: SaturationPolicy) -> list[EndpointSnapshot]:
    """Healthy endpoints with fresh metrics where a critical request would wait behind fewer than `policy.max_queue`
    critical requests of this gateway's: engines run critical requests first (and preempt for them), so a saturated
    engine still starts one soon; only critical requests it has not started are ahead of it (--critical-first)."""
    return [e for e in endpoints if e.healthy and not policy.is_stale(e) and e.critical_pending < policy.max_queue]


def typical_rate(endpoints: Sequence[EndpointSnapshot]) -> float | None:
    """The fleet's median measured prefill rate. An engine that has not measured its own yet (just started, or idle
    since) is taken to be this fast: fleets serve one model, and a constant would favour or shun it wrongly."""
    rates = sorted(e.prefill_rate for e in endpoints if e.prefill_rate)
    return rates[len(rates) // 2] if rates else None


def lower_class_tokens(e: EndpointSnapshot) -> int:
    """Prompt tokens of lower classes an engine has yet to compute, as far as the gateway knows: the pending prefill
    it last reported and this gateway's dispatches since, less the critical prompts this gateway sent there that
    have not started."""
    return max(0, e.prefill_tokens_pending + e.in_flight_tokens - e.critical_pending_tokens)


def soonest_critical_start(room: Sequence[EndpointSnapshot], request: RoutingContext,
                           rng: random.Random) -> EndpointSnapshot:
    """Where a critical request's first token comes soonest: engines run critical prompts first (and preempt lower
    classes for them), so it waits for the critical prompts this gateway sent there that have not started and for
    the lower-class prefill in progress (a chunk of it, or a whole prompt where the engine does not chunk), then
    computes its own tokens not cached there; each over the engine's prefill rate (the fleet's median where it
    has not measured its own; tokens alone where none has). The gateway does not see which lower-class prompt is in
    progress, so the lower-class prefill pending there (lower_class_tokens) stands for it: an engine with none
    starts the request at once. Ties (token counts unknown) go to the engine with fewer critical requests pending,
    then fewer outstanding requests, then at random. Counting critical prompts rather than their length, blind to
    lower classes, sent critical prompts whose prefill nearly fills the objective behind another prompt while an
    engine had none (the replay's held-out traces: kvfleet/autoscale_replay)."""
    fleet_rate = typical_rate(room) or 1.0

    def start_s(e: EndpointSnapshot) -> float:
        own = request.num_tokens * (1.0 - request.prefix_matches.get(e.url, 0.0))
        return (e.critical_pending_tokens + lower_class_tokens(e) + own) / (e.prefill_rate or fleet_rate)

    return min(room, key=lambda e: (start_s(e), e.critical_pending, outstanding(e), rng.random()))


LANE_MIN_ENGINES = 2  # a critical lane only where another engine is left for the lower classes
LANE_HOLD_S = 60.0  # the lane is kept this long after the last critical request


def critical_lane(endpoints: Sequence[EndpointSnapshot], policy: SaturationPolicy) -> frozenset[str]:
    """The engine kept free of lower-class work for critical requests (--critical-lane, while critical requests
    come): of the healthy engines with fresh metrics, when there are at least LANE_MIN_ENGINES, the first by URL,
    so that every gateway replica keeps the same one and it stays while the fleet scales. A critical prompt whose
    prefill nearly fills its objective is in time only on an engine with no other prompt prefilling; this one has
    none but critical ones."""
    fresh = sorted(e.url for e in endpoints if e.healthy and not policy.is_stale(e))
    return frozenset(fresh[:1]) if len(fresh) >= LANE_MIN_ENGINES else frozenset()


def serving(endpoints: list[EndpointSnapshot], adapter: str | None) -> list[EndpointSnapshot]:
    """The engines a request may go to: for an adapter, those whose /v1/models lists it or has not been read yet
    (a pod that has not loaded it would answer 404: a new pod before the operator's load, a pod of another fleet
    size); all of them when none does (the engine's answer then says what it serves)."""
    if adapter is None:
        return endpoints
    holding = [e for e in endpoints if e.adapters_served is None or adapter in e.adapters_served]
    return holding or endpoints


def pick(strategy: Strategy, endpoints: Sequence[EndpointSnapshot], request: RoutingContext,
         rng: random.Random, critical: SaturationPolicy | None = None) -> EndpointSnapshot | None:
    """The strategy's choice among the endpoints not excluded. With `critical` (a critical request, --critical-first),
    among those with room for it (critical_room, saturated or not), the one where it starts soonest
    (soonest_critical_start). With request.must, a healthy endpoint is returned even when all are saturated: the
    least loaded one."""
    endpoints = [e for e in endpoints if e.url not in request.exclude]
    if critical is not None and (room := critical_room(endpoints, critical)):
        return soonest_critical_start(room, request, rng)
    chosen = strategy.choose(endpoints, request, rng)
    if chosen is None and request.must:
        healthy = [e for e in endpoints if e.healthy]
        if healthy:
            chosen = min(healthy, key=lambda e: (e.queue_depth, e.kv_cache_usage, rng.random()))
    return chosen


def free_slots(endpoints: Sequence[EndpointSnapshot], policy: SaturationPolicy = SaturationPolicy()) -> int:
    """How many queued requests the fleet can take now: on each available endpoint, its free batch slots and room for
    `policy.release_queue` waiting requests; for an engine that does not say its batch capacity, its room below the
    saturation queue limit (at least one)."""
    total = 0
    for e in available(endpoints, policy):
        if e.max_num_seqs:
            free_batch = max(0, e.max_num_seqs - e.num_running - e.in_flight)
            total += max(0, free_batch + policy.release_queue - e.queue_depth)
        else:
            total += max(1, policy.max_queue - e.queue_depth)
    return total
