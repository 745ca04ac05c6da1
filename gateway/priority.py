"""Priority classes and the fleet queue's order: strict priority across classes, FCFS within one, with aging.

An entry's position is fixed when it is queued: score = arrival_ms + rank × aging_ms. Within `aging_ms` a higher
class always goes first; a request that has waited longer than that overtakes fresh arrivals of the class above
it, so nothing starves. One number per entry is what lets one Redis sorted set serve every gateway replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Priority(StrEnum):
    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        return _RANKS[self]


_RANKS = {Priority.CRITICAL: 0, Priority.STANDARD: 1, Priority.SHEDDABLE: 2}
PRIORITY_NAMES = ", ".join(p.value for p in Priority)


def parse_priority(value: str | None) -> Priority:
    """The `x-kvfleet-priority` header; absent means standard."""
    if value is None or value == "":
        return Priority.STANDARD
    try:
        return Priority(value.strip().lower())
    except ValueError:
        raise ValueError(f"x-kvfleet-priority must be one of {PRIORITY_NAMES}, not {value!r}") from None


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
