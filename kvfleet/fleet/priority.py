"""Priority as one concept: the classes a request carries through the fleet, their engine priority, and who may set it.

Two vocabularies meet here. The gateway orders and sheds by class (`critical`, `standard`, `sheddable`); the
engine admits and preempts by an integer, vLLM's semantics, lower first. `engine_priority` is the one translation.

The trust rule (`forwarded_engine_priority`), what each source may set:
- the header `x-kvfleet-priority`, from any client: the class, which decides where the request waits in the
  gateway's queue and whether it is shed; absent means standard. A class above the client's API key's max_class,
  else the gateway's --max-class (default critical: anyone), is refused with 403 (gateway/limits/class_grant.py).
- an API key marked `allow_priority=true`: also the engine's integer `priority` in the body, passed on as sent.
- a body `priority` from any other client (a key without allow_priority, or a gateway without API keys): nothing;
  it is dropped, and the engine's priority comes from the class when the gateway forwards it.
"""

from __future__ import annotations

from enum import StrEnum

from kvfleet.fleet.headers import PRIORITY


class Priority(StrEnum):
    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """0 for the class served first."""
        return _RANKS[self]


_RANKS = {Priority.CRITICAL: 0, Priority.STANDARD: 1, Priority.SHEDDABLE: 2}
PRIORITY_NAMES = ", ".join(p.value for p in Priority)
DEFAULT_PRIORITY = Priority.STANDARD

ENGINE_DEFAULT_PRIORITY = 0  # what an engine assumes when a body has no `priority`
# Sheddable work an engine has accepted is not pushed back there: engines order strictly by priority, without the
# gateway queue's aging, so it could starve behind a steady stream.
_ENGINE_PRIORITY = {Priority.CRITICAL: -2, Priority.STANDARD: ENGINE_DEFAULT_PRIORITY,
                    Priority.SHEDDABLE: ENGINE_DEFAULT_PRIORITY}
# A standard request whose tenant holds less than an equal share of the requests in flight goes ahead of the rest of
# its class inside the engines too (behind critical): the engines' queues and preemption then keep the tenants' fair
# share (gateway/queue/fair_order.py) instead of undoing it first come, first served.
UNDER_SHARE_ENGINE_PRIORITY = -1
# Background work (the Batch API's requests): below every interactive class. kvfleet's engines let requests at this
# priority or above sit out the steps in which a higher-priority request prefills (engine/scheduler.py).
BATCH_ENGINE_PRIORITY = 10


def parse_priority(value: str | None) -> Priority:
    """The `x-kvfleet-priority` header; absent means standard."""
    if value is None or value == "":
        return DEFAULT_PRIORITY
    try:
        return Priority(value.strip().lower())
    except ValueError:
        raise ValueError(f"{PRIORITY} must be one of {PRIORITY_NAMES}, not {value!r}") from None


def engine_priority(priority: Priority) -> int:
    """The engine's integer priority for a class (lower runs first, as in vLLM)."""
    return _ENGINE_PRIORITY[priority]


def forwarded_engine_priority(priority: Priority, body_priority: int | None, key_may_set: bool,
                              forward: bool, under_share: bool = False) -> int | None:
    """The `priority` the engine gets in the forwarded body, or None for none (the engine's default).

    `body_priority` is the client's body `priority` (None when absent), kept only when `key_may_set` (its API key
    has allow_priority); otherwise, when `forward`, the class's engine priority if it differs from the default, or
    for a standard request whose tenant is `under_share` (fewer requests in flight than an equal share),
    UNDER_SHARE_ENGINE_PRIORITY.
    """
    if key_may_set and body_priority is not None:
        return body_priority
    if forward and under_share and priority is Priority.STANDARD:
        return UNDER_SHARE_ENGINE_PRIORITY
    if forward and engine_priority(priority) != ENGINE_DEFAULT_PRIORITY:
        return engine_priority(priority)
    return None
