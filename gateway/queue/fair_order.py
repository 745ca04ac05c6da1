"""Which queued request goes next: weighted fair share among tenants inside each priority band, strict priority
with aging across bands. The pure policy, which the in-process queue runs and the Redis queue's Lua mirrors.

Fair share is virtual token counters (VTC, "Fairness in Serving Large Language Models", Sheng et al., OSDI'24):
each tenant has, per band, a counter of the service it received (tokens / weight). A band's candidate is the head
of its queued tenant with the lowest counter (ties: the lower name), a tenant's own entries going earliest deadline
first (ties: the lower id); the band whose candidate has the lower `queue_order.queue_score` goes first, so aging
still lets an old request overtake a busier band above it.
A tenant that becomes active (had nothing queued in the band) is lifted to the lowest counter of the tenants active
there (or, none being active, to the counter of the last tenant that left): idle time is not banked as credit.
Counters of idle tenants are kept up to `max_idle` per band, the lowest dropped first (a lift would raise them).

With policy "fcfs" the order is today's: the lowest score first, whatever the tenant (nothing is charged).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.order import QueueEntry

QUEUE_POLICIES = ("fair", "fcfs")
MAX_IDLE_TENANTS = 10_000  # per band: counters of tenants with nothing queued (clients choose tenant names)
# `ahead` visits each other queued tenant of a band up to this many; beyond it (tenant names are the client's to
# choose, and a visit per tenant on every enqueue would let a flood of names load Redis) it takes a bound instead
TENANTS_VISITED = 64


@dataclass
class Band:
    """One priority band's tenants: counters of the active (queued) and the idle ones, and their queued entries."""

    active: dict[str, float] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=dict)
    floor: float = 0.0  # the counter of the last tenant that left `active`
    queued: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # tenant -> sorted (deadline, id)


class FairOrder:
    """Queued entries of every band and the tenants' counters; `pop` takes the next entry by the policy."""

    def __init__(self, policy: str = "fair", max_idle: int = MAX_IDLE_TENANTS):
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"the queue policy must be one of {', '.join(QUEUE_POLICIES)}, not {policy!r}")
        self.policy, self.max_idle = policy, max_idle
        self.bands = {p: Band() for p in Priority}
        self.entries: dict[str, QueueEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: QueueEntry) -> None:
        if entry.id in self.entries:
            return
        band = self.bands[entry.priority]
        if entry.tenant not in band.active:
            self._activate(band, entry.tenant)
        bisect.insort(band.queued.setdefault(entry.tenant, []), (entry.deadline_ms, entry.id))
        self.entries[entry.id] = entry

    def remove(self, entry_id: str) -> QueueEntry | None:
        entry = self.entries.pop(entry_id, None)
        if entry is None:
            return None
        band = self.bands[entry.priority]
        queued = band.queued[entry.tenant]
        queued.pop(bisect.bisect_left(queued, (entry.deadline_ms, entry.id)))
        if not queued:
            del band.queued[entry.tenant]
            counter = band.active.pop(entry.tenant)
            band.idle[entry.tenant] = band.floor = counter
            self._trim(band)
        return entry

    def pop(self, charge: bool = True) -> QueueEntry | None:
        """The next entry by the policy, out of the queue; in fair mode its tenant is charged its cost first."""
        entry = self.peek()
        if entry is None:
            return None
        if charge and self.policy == "fair":
            self.charge(entry.priority, entry.tenant, entry.charge)
        return self.remove(entry.id)

    def peek(self) -> QueueEntry | None:
        if self.policy == "fcfs":
            return min(self.entries.values(), key=lambda e: (e.score, e.id), default=None)
        best: QueueEntry | None = None
        for p in sorted(Priority, key=lambda p: p.rank):
            band = self.bands[p]
            if band.active:
                tenant = min(band.active, key=lambda t: (band.active[t], t))
                head = self.entries[band.queued[tenant][0][1]]
                if best is None or head.score < best.score:
                    best = head
        return best

    def ahead(self, entry: QueueEntry) -> int:
        """About how many queued entries go before `entry` (not queued yet; ties left out): under fcfs those with a
        lower score; under fair every entry of the bands above, its tenant's own with earlier deadlines (k), and of
        each other tenant in its band at most k + 1 (as if tenants took turns one request at a time: weights and
        counters are left out, so a tenant far behind on service is served sooner than this says). With more than
        TENANTS_VISITED other tenants, the smaller of their entries and (k + 1) per tenant."""
        if self.policy == "fcfs":
            return sum(1 for e in self.entries.values() if e.score < entry.score)
        above = sum(len(q) for p in Priority if p.rank < entry.priority.rank
                    for q in self.bands[p].queued.values())
        band = self.bands[entry.priority]
        own = band.queued.get(entry.tenant, [])
        k = bisect.bisect_left(own, (entry.deadline_ms, ""))  # strictly earlier deadlines
        others = len(band.queued) - (entry.tenant in band.queued)
        if k == 0:
            return above + others
        if others <= TENANTS_VISITED:
            return above + k + sum(min(len(q), k + 1) for t, q in band.queued.items() if t != entry.tenant)
        theirs = sum(len(q) for q in band.queued.values()) - len(own)
        return above + k + min(theirs, (k + 1) * others)

    def queued_by(self, tenant: str) -> int:
        """The tenant's entries in every band."""
        return sum(len(band.queued.get(tenant, ())) for band in self.bands.values())

    def charge(self, priority: Priority, tenant: str, amount: float) -> None:
        """Adds service (tokens / weight, negative for a correction) to a tenant's counter in a band."""
        band = self.bands[priority]
        if tenant in band.active:
            band.active[tenant] += amount
        else:
            band.idle[tenant] = band.idle.get(tenant, 0.0) + amount
            self._trim(band)

    def counter(self, priority: Priority, tenant: str) -> float:
        band = self.bands[priority]
        return band.active.get(tenant, band.idle.get(tenant, 0.0))

    def _activate(self, band: Band, tenant: str) -> None:
        own = band.idle.pop(tenant, 0.0)
        lift = min(band.active.values()) if band.active else band.floor
        band.active[tenant] = max(own, lift)

    def _trim(self, band: Band) -> None:
        excess = len(band.idle) - self.max_idle
        if excess > 0:
            for tenant, _ in sorted(band.idle.items(), key=lambda tc: (tc[1], tc[0]))[:excess]:
                del band.idle[tenant]
