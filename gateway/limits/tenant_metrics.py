"""Per-tenant metrics with bounded cardinality: the top N tenants by traffic get their own series, the rest "other".

Tenant names are the client's to choose (the x-kvfleet-tenant header), so a series per raw name would let anyone
create series without end. `TenantLabels` (pure) keeps a decayed Misra-Gries summary of requests per tenant, a
fixed number of counters whatever names arrive, and re-decides every few seconds, with hysteresis, which tenants are
named; `TenantMetrics` removes a demoted tenant's series, so at most N + 1 tenant labels are ever live.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from kvfleet.gateway.limits.usage import Settlement, Usage
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.token_estimate import Cost, request_cost

OTHER = "other"  # every tenant outside the top; a tenant named "other" is never named apart from them
COUNTERS_PER_NAME = 4  # the summary's size: a tenant with over 1/(4N + 1) of the requests is always in it
REFRESH_S = 5.0  # labels are re-decided at most this often: a tenant's series do not flap request by request
HALF_LIFE_S = 60.0  # traffic counts halve every minute: yesterday's top tenant does not stay named
MIN_REQUESTS = 3.0  # decayed requests a tenant needs to be named (a name sent once never gets a series)
HYSTERESIS = 2.0  # a named tenant keeps its name until a newcomer has twice its traffic (or it falls below half)
FORGET_BELOW = 0.5  # decayed counts below this free their counter


@dataclass(frozen=True)
class Relabel:
    """What one decision changed: tenants that got their own series, and tenants whose series go."""

    promoted: frozenset[str]
    demoted: frozenset[str]


class TenantLabels:
    """Which label a tenant's observations get: its name while it is among the top `top` by recent requests, else
    "other". Memory: at most COUNTERS_PER_NAME x top counters, whatever names clients send."""

    def __init__(self, top: int, refresh_s: float = REFRESH_S, half_life_s: float = HALF_LIFE_S,
                 min_requests: float = MIN_REQUESTS):
        self.top, self.refresh_s, self.half_life_s, self.min_requests = top, refresh_s, half_life_s, min_requests
        self.capacity = COUNTERS_PER_NAME * top
        self.counts: dict[str, float] = {}
        self.named: frozenset[str] = frozenset()
        self._decided_at: float | None = None

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.named else OTHER

    def observe(self, tenant: str, now: float) -> Relabel | None:
        """Counts one request of `tenant` (Misra-Gries: a new name with the table full takes one from every
        counter instead, amortized O(1)); returns the change when a decision was due."""
        if tenant in self.counts:
            self.counts[tenant] += 1.0
        elif len(self.counts) < self.capacity:
            self.counts[tenant] = 1.0
        else:
            for name, count in list(self.counts.items()):
                if count > 1.0:
                    self.counts[name] = count - 1.0
                else:
                    del self.counts[name]
        return self.decide_if_due(now)

    def decide_if_due(self, now: float) -> Relabel | None:
        if self._decided_at is not None and now - self._decided_at < self.refresh_s:
            return None
        return self.decide(now)

    def decide(self, now: float) -> Relabel:
        """Decays the counts to `now` and picks the named tenants: the top by count, a named one's count doubled."""
        if self._decided_at is not None:
            factor = 0.5 ** ((now - self._decided_at) / self.half_life_s)
            self.counts = {n: c * factor for n, c in self.counts.items() if c * factor >= FORGET_BELOW}
        self._decided_at = now

        def score(name: str) -> float:
            return self.counts[name] * (HYSTERESIS if name in self.named else 1.0)

        eligible = [name for name in self.counts if score(name) >= self.min_requests and name != OTHER]
        named = frozenset(heapq.nlargest(self.top, eligible, key=lambda name: (score(name), name)))
        change = Relabel(named - self.named, self.named - named)
        self.named = named
        return change


class TenantMetrics:
    """The gateway's per-tenant series (kvfleet_gateway_tenant_*), each observation under `TenantLabels`' label."""

    def __init__(self, metrics: GatewayMetrics, top: int, clock: Callable[[], float] = time.monotonic):
        self.labels = TenantLabels(top)
        self._families = (metrics.tenant_queued, metrics.tenant_served_tokens, metrics.tenant_queue_wait)
        self._queued, self._served, self._wait = self._families
        self._shed = metrics.tenant_shed
        self._clock = clock
        self._waiting: dict[str, int] = {}  # this replica's queued requests by tenant (only tenants with some)
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self._shed_reasons: set[str] = set()

    def arrived(self, tenant: str) -> None:
        """One request of `tenant`: the traffic that ranks tenants."""
        self._apply(self.labels.observe(tenant, self._clock()))

    def refresh(self) -> None:
        """Re-decides the labels if due (at a scrape: a tenant that stopped sending is demoted without traffic)."""
        self._apply(self.labels.decide_if_due(self._clock()))

    def queued(self, tenant: str, delta: int) -> None:
        waiting = self._waiting.get(tenant, 0) + delta
        if waiting > 0:
            self._waiting[tenant] = waiting
        else:
            self._waiting.pop(tenant, None)
        self._child(self._queued, self.labels.label(tenant)).inc(delta)

    def waited(self, tenant: str, seconds: float) -> None:
        self._child(self._wait, self.labels.label(tenant)).observe(seconds)

    def shed(self, tenant: str, reason: str) -> None:
        self._shed_reasons.add(reason)  # a few fixed words (admission's, the rate limits')
        self._child(self._shed, self.labels.label(tenant), reason).inc()

    def served(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            self._child(self._served, self.labels.label(tenant)).inc(tokens)

    def counted(self, tenant: str, settlement: Settlement | None, body: dict) -> Settlement:
        """The request's settlement, counting the engine's tokens for `tenant`; made for the count alone when
        there is no key or fair-share reservation to settle (then it settles nothing else)."""
        cost = settlement.cost if settlement is not None else request_cost(body)
        return ServedSettlement(settlement, cost, lambda tokens: self.served(tenant, tokens))

    def _child(self, metric: MetricWrapperBase, *values: str) -> MetricWrapperBase:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _apply(self, change: Relabel | None) -> None:
        """Removes the demoted tenants' series and moves the waiting counts of everyone relabelled."""
        if change is None or not (change.promoted or change.demoted):
            return
        for key in [k for k in self._children if k[1][0] in change.demoted]:
            del self._children[key]
        for name in change.demoted:
            for metric in self._families:
                metric.remove(name)
            for reason in self._shed_reasons:
                self._shed.remove(name, reason)
        other = 0
        for tenant, waiting in self._waiting.items():
            if tenant in change.promoted:
                self._child(self._queued, tenant).set(waiting)
            elif tenant not in self.labels.named:
                other += waiting
        self._child(self._queued, OTHER).set(other)


class ServedSettlement(Settlement):
    """A settlement that also counts what the engine reported (`usage.total_tokens`, prompt + completion) as served;
    the key's and the tenant's own settlement, if any, is settled through it unchanged. Answers without a count (a
    stream cut short, a client that left) settle their reservation but count nothing served."""

    def __init__(self, inner: Settlement | None, cost: Cost, served: Callable[[int], None]):
        super().__init__(cost, (lambda actual: inner(Usage(actual))) if inner is not None else _nothing)
        self._served = served

    def __call__(self, usage: Usage) -> None:
        if self.settled is None and usage.total is not None:
            self._served(usage.total)
        super().__call__(usage)


def _nothing(_: int) -> None:
    pass
