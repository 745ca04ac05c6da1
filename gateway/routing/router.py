"""The one owner of the routing decision: ranks the engines for a request (its choice, then the fallbacks a retry
takes) and records where it went. The Python proxy and the Envoy picker both route through it."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.engines.pool import EndpointPool, nothing_counted
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys
from kvfleet.gateway.routing.pick import LANE_HOLD_S, EndpointSnapshot, RoutingContext, critical_lane, pick, serving
from kvfleet.gateway.routing.strategies import strategy_named


@dataclass(frozen=True)
class Dispatch:
    """Where a request goes: its engine, the next best for a retry elsewhere, and the call that ends a critical
    request's count at its engine (its answer started, or the request ended without one; a no-op otherwise)."""

    url: str
    fallbacks: tuple[str, ...] = ()
    started: Callable[[], None] = nothing_counted


class Router:
    def __init__(self, config: GatewayConfig, pool: EndpointPool, prefix: PrefixRouting, metrics: GatewayMetrics,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.pool, self.prefix, self.metrics = config, pool, prefix, metrics
        self.rng, self.clock = rng or random.Random(), clock
        # round-robin's rotation starts at a random engine, as Envoy's round robin does per worker: replicas started
        # together would otherwise send their first requests to the same engines in lockstep
        self._turn = self.rng.randrange(1 << 30)
        self._critical_at = -math.inf  # when this gateway last routed a critical request

    def reserved(self, snapshots: Sequence[EndpointSnapshot]) -> frozenset[str]:
        """The engines lower-class requests may not use now: the critical lane (--critical-lane), kept while this
        gateway has routed a critical request in the last LANE_HOLD_S."""
        if not self.config.critical_lane or self.clock() - self._critical_at > LANE_HOLD_S:
            return frozenset()
        return critical_lane(snapshots, self.config.saturation)

    def rank(self, hashes: PromptKeys, exclude: frozenset[str] = frozenset(), must: bool = False,
             critical: bool = False, fallbacks: int = 0) -> list[str]:
        """The engine for a request, then up to `fallbacks` next best for a retry elsewhere (picked as an admitted
        request is: a saturated engine rather than none); empty when no engine may serve it. `must`: the request
        was admitted, so a saturated engine is picked rather than none; `critical`: a critical request, which
        --critical-first routes past saturation; a request of another class does not go to the critical lane
        (reserved). The choice is counted in kvfleet_gateway_routing_decisions."""
        self._turn += 1
        c = self.config
        strategy = strategy_named(c.routing, c.weights, c.saturation)
        matches = self.prefix.matches(hashes)
        snapshots = serving(self.pool.snapshots(), hashes.adapter)
        if critical:
            self._critical_at = self.clock()
        else:
            exclude |= self.reserved(snapshots)
        request = RoutingContext(matches, exclude, must, turn=self._turn, num_tokens=hashes.est_tokens,
                                 adapter=hashes.adapter)
        chosen = pick(strategy, snapshots, request, self.rng, c.saturation if critical and c.critical_first else None)
        if chosen is None:
            return []
        self.metrics.labelled(self.metrics.routing_decisions, self.prefix.reason(matches, chosen.url)).inc()
        urls = [chosen.url]
        for _ in range(fallbacks):
            # turn 0: round-robin's rotation belongs to the first choices; a fallback is only used when one fails
            context = RoutingContext(matches, exclude | frozenset(urls), must=True, turn=0,
                                     num_tokens=hashes.est_tokens, adapter=hashes.adapter)
            fallback = pick(strategy, snapshots, context, self.rng)
            if fallback is None:
                break
            urls.append(fallback.url)
        return urls

    def choose(self, hashes: PromptKeys, exclude: frozenset[str] = frozenset(), must: bool = False,
               critical: bool = False) -> str | None:
        """The engine for a request (rank's first), or None."""
        ranked = self.rank(hashes, exclude, must, critical)
        return ranked[0] if ranked else None

    def dispatch(self, hashes: PromptKeys, exclude: frozenset[str] = frozenset(), critical: bool = False,
                 fallbacks: int = 0) -> Dispatch | None:
        """The engine an admitted request goes to now (a saturated one rather than none), none of `exclude`, and up
        to `fallbacks` more for a retry elsewhere, with the dispatch recorded (dispatched()) and a critical request's
        prompt tokens counted at its engine until Dispatch.started; None when no engine may serve it."""
        urls = self.rank(hashes, exclude, must=True, critical=critical, fallbacks=fallbacks)
        if not urls:
            return None
        return self.dispatch_to(hashes, urls[0], critical, tuple(urls[1:]))

    def dispatch_to(self, hashes: PromptKeys, url: str, critical: bool = False,
                    fallbacks: tuple[str, ...] = ()) -> Dispatch:
        """The request goes to `url`, chosen already (a fallback named by an earlier dispatch), recorded as
        dispatch() records its pick."""
        tokens = self.dispatched(hashes, url)
        started = self.pool.critical_sent(url, tokens) if critical else nothing_counted
        return Dispatch(url, fallbacks, started)

    def dispatched(self, hashes: PromptKeys, url: str) -> int:
        """The request goes to url: the prompt tokens the engine likely computes for it count on the engine until
        its next scrape, the routed metric counts it, and the prefix it sends is taken as held there (the next
        requests sharing it follow before the engine's own events say so). Returns those tokens."""
        tokens = self.prefix.uncached_tokens(hashes, url)
        self.pool.record_dispatch(url, tokens, hashes.adapter)
        self.metrics.labelled(self.metrics.routed, url).inc()
        if hashes.adapter is not None:
            self.metrics.labelled(self.metrics.lora_requests, hashes.adapter).inc()
        self.prefix.record(hashes, url)
        return tokens
