"""What happens to a request on arrival: route it now, queue it, or refuse it (the shedding verdict, pure), and the
refusals' answers: what each says, its status and code, and when to come back."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.headers import PRIORITY as PRIORITY_HEADER
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.order import Placement, Refusal
from kvfleet.gateway.queue.wait import predicted_wait_s, retry_after_s


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


def no_engine(detail: str = "no engine is available", status: int = 503) -> APIError:
    """The answer when no engine can take a request (none healthy, none serving its model yet, or, 502, the ones
    tried failed): the client may retry in a second."""
    return APIError(status, f"{detail}; retry shortly", "service_unavailable", code="no_engine",
                    headers={headers.RETRY_AFTER: "1"})


def shed_refusal(reason: str, message: str, retry_after: int) -> APIError:
    """A shed request's 429: its reason in the code, and when to come back."""
    return APIError(429, message, "rate_limit_exceeded", code=f"shed_{reason}",
                    headers={headers.RETRY_AFTER: str(retry_after)})


def queue_refusal(priority: Priority, tenant: str, placement: Placement, rate: float | None, max_queue_ms: float,
                  class_cap: int, queued: int) -> tuple[str, APIError]:
    """Why the fleet queue would not take a request, and the answer: its class or its tenant is at its cap (429),
    or the queue ahead of it would not drain by its deadline at the fleet's drain rate `rate` (503; 429 for
    sheddable), each with a Retry-After (a full class's: once the `queued` entries have drained)."""
    if placement.refusal is Refusal.CLASS_FULL:
        return "queue_full", shed_refusal("queue_full", f"the fleet queue for {priority.value} requests is full "
                                                        f"({class_cap} waiting); retry later",
                                          retry_after_s(queued, rate))
    if placement.refusal is Refusal.TENANT_FULL:
        wait = retry_after_s(placement.ahead, rate)
        return "tenant_queue_full", shed_refusal(
            "tenant_queue_full", f"tenant {tenant!r} already has {placement.ahead} requests waiting in the fleet "
                                 f"queue, the most it may (max_queued); retry in {wait} s", wait)
    wait, retry = predicted_wait_s(placement.ahead, rate), retry_after_s(placement.ahead, rate, max_queue_ms)
    # `rate` is read again after the queue decided: a rate that has since left its window (or a queue that fell
    # back from Redis to this process meanwhile) has none to quote
    ahead = (f"{placement.ahead} requests are queued ahead of this request, more than drain in" if wait is None else
             f"about {wait:.1f} s of queued work is ahead of this request ({placement.ahead} requests, the fleet "
             f"serving {rate:.2f}/s), longer than")
    return "deadline_predicted", APIError(
        429 if priority is Priority.SHEDDABLE else 503,
        f"{ahead} the {max_queue_ms:.0f} ms it may wait ({headers.MAX_QUEUE_MS}); retry in {retry} s, or allow a "
        "longer wait", "service_unavailable", code="queue_deadline_unreachable",
        headers={headers.RETRY_AFTER: str(retry)})
