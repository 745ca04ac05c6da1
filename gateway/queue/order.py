"""The fleet queue's order across classes: strict priority with aging (inside a class, queue/fair_order.py decides).

An entry's position is fixed when it is queued: score = arrival_ms + rank × aging_ms. Within `aging_ms` a higher
class always goes first; a request that has waited longer than that overtakes fresh arrivals of the class above
it, so nothing starves. Inside a class the score also orders each tenant's own entries (first come, first served).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvfleet.fleet.priority import Priority

DEFAULT_TENANT = "default"  # the tenant of a request without an API key or an x-kvfleet-tenant header


def queue_score(arrival_ms: float, priority: Priority, aging_ms: float) -> float:
    """Lower is served first."""
    return arrival_ms + priority.rank * aging_ms


@dataclass(frozen=True)
class QueueEntry:
    """One waiting request, as every gateway replica sees it."""

    id: str
    priority: Priority
    score: float
    deadline_ms: float  # wall-clock epoch ms after which the owner answers 503
    owner: str  # the gateway replica holding the client's connection
    tenant: str = DEFAULT_TENANT
    charge: float = 0.0  # its estimated tokens / its tenant's weight, added to the tenant's counter on release
    arrival_ms: float | None = None  # wall-clock epoch ms it was queued at (its wait counts in the drain rate)


class Refusal(StrEnum):
    """Why the queue would not take an entry (each is a shed reason in the gateway's metrics)."""

    CLASS_FULL = "queue_full"  # its class holds its cap of entries
    TENANT_FULL = "tenant_queue_full"  # its tenant holds its cap of entries
    TOO_LONG = "deadline"  # more wait ahead of it than its deadline allows


@dataclass(frozen=True)
class Placement:
    """What queueing an entry did: queued (refusal None) or not, and about how many entries go before it."""

    refusal: Refusal | None
    ahead: int

    @property
    def queued(self) -> bool:
        return self.refusal is None
