"""Who may claim which class: a request's `x-kvfleet-priority` may go up to its API key's max_class, else the
gateway's --max-class. A claim above it is refused (403) rather than lowered, so the client learns what it may send
and the critical class's counts (queue, SLO, autoscaler margin) hold only the work an operator granted it."""

from __future__ import annotations

from typing import Any

from kvfleet.fleet.errors import APIError
from kvfleet.fleet.headers import PRIORITY
from kvfleet.fleet.priority import DEFAULT_PRIORITY, Priority


def class_ceiling(key: Any | None, gateway_max: Priority) -> Priority:
    """The highest class a request may claim: its key's max_class where the key sets one, else the gateway's."""
    own = getattr(key, "max_class", None)
    return gateway_max if own is None else own


def may_claim(claimed: Priority, ceiling: Priority) -> bool:
    """Whether `claimed` is at or below `ceiling` (critical is the highest class)."""
    return claimed.rank >= ceiling.rank


def class_refusal(claimed: Priority, ceiling: Priority, keyed: bool) -> APIError | None:
    """None when the claim is allowed, else the 403 to answer, saying what to send instead and how to get more;
    `keyed`: the gateway has API keys (the ceiling is the key's or the default for keys)."""
    if may_claim(claimed, ceiling):
        return None
    allowed = " or ".join(p.value for p in Priority if may_claim(p, ceiling))
    who = "this API key may send" if keyed else f"this gateway (--max-class {ceiling.value}) accepts"
    grant = (f"ask for a key with max_class={claimed.value}" if keyed
             else f"ask its operator for an API key with max_class={claimed.value}")
    implied = " (a request without it is standard)" if claimed is DEFAULT_PRIORITY else ""
    return APIError(403, f"{who} {PRIORITY} up to {ceiling.value}, not {claimed.value}{implied}; send {allowed}, "
                         f"or {grant}", "permission_error", param=PRIORITY, code="class_not_allowed")
