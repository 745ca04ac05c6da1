"""What happens to a request on arrival: route it now, queue it, or refuse it (the shedding verdict, pure)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvfleet.fleet.headers import PRIORITY as PRIORITY_HEADER
from kvfleet.fleet.priority import Priority


class Action(StrEnum):
    ROUTE = "route"
    QUEUE = "queue"
    SHED = "shed"


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str | None = None  # for SHED: "saturated" or "queue_full"
    message: str | None = None


def admit(priority: Priority, fleet_has_capacity: bool, queued_total: int, queued_in_class: int,
          class_cap: int, critical_has_room: bool = False) -> Verdict:
    """Route while there is room and nobody waits; otherwise queue, except sheddable traffic and full classes.
    A critical request also routes while an engine has room for it (routing.critical_room, --critical-first): the
    engines run critical requests first, so holding it in the gateway behind a saturated fleet only delays it."""
    if fleet_has_capacity and queued_total == 0:
        return Verdict(Action.ROUTE)
    if priority is Priority.CRITICAL and critical_has_room:
        return Verdict(Action.ROUTE)
    if priority is Priority.SHEDDABLE:  # others waiting means the fleet is saturated too: sheddable never waits
        return Verdict(Action.SHED, "saturated", "every engine is saturated and sheddable requests are not queued; "
                                                 f"retry later or send a higher {PRIORITY_HEADER}")
    if queued_in_class >= class_cap:
        return Verdict(Action.SHED, "queue_full", f"the fleet queue for {priority.value} requests is full "
                                                  f"({class_cap} waiting); retry later")
    return Verdict(Action.QUEUE)
