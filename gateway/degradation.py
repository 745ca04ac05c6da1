"""The degradation ladder, pure. Its first rung: while the fleet is saturated (a request arriving would wait, or
passes only by the critical-first rule), a request of a class given a cap has its output allowance lowered to it,
so every answer in the batch ends sooner and the queue drains faster. Its second: a request its client (or key)
lets fall back goes to its model's fallback model while that one has room (gateway/models/front.py). The answer says
which in `x-kvfleet-degraded`. The last rung is shedding (admission.py). Nothing changes while the fleet has room."""

from __future__ import annotations

from collections.abc import Mapping

from kvfleet.fleet.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS
from kvfleet.fleet.priority import Priority

STEP_MAX_TOKENS = "max_tokens"  # the steps' names in kvfleet_gateway_degraded_total and the answer's header
STEP_FALLBACK = "fallback"
FALLBACK_VALUES = {"true": True, "false": False, "": False}  # x-kvfleet-allow-fallback's values


def output_cap(priority: Priority, saturated: bool, caps: Mapping[Priority, int]) -> int | None:
    """The most output tokens a request of this class may ask for now; None: no cap applies."""
    return caps.get(priority) if saturated else None


def cap_output(path: str, body: dict, cap: int) -> bool:
    """Lower the body's output allowance to `cap` where it asks for more (completions: max_tokens, whose absence
    means OpenAI's 16; chat: max_completion_tokens and max_tokens, whose absence means what the context leaves);
    whether it changed the body."""
    if path.endswith("/chat/completions"):
        asked = [body[f] for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None]
        if asked and min(asked) <= cap:
            return False
        for field in ("max_completion_tokens", "max_tokens"):
            if body.get(field) is not None or field == "max_tokens":
                body[field] = cap
        return True
    asked = body.get("max_tokens")
    if (COMPLETIONS_DEFAULT_MAX_TOKENS if asked is None else asked) <= cap:
        return False
    body["max_tokens"] = cap
    return True


def header_value(cap: int) -> str:
    return f"{STEP_MAX_TOKENS}={cap}"


def fallback_header_value(model: str) -> str:
    return f"{STEP_FALLBACK}={model}"


def step_of(header: str) -> str:
    """The step's name in a DEGRADED header value."""
    return header.partition("=")[0]


def fallback_allowed(header: str | None, key_allows: bool) -> bool:
    """Whether a request may go to a fallback model: its key allows it, or the client asks with the header.
    ValueError for a header value that is neither true nor false."""
    try:
        asked = FALLBACK_VALUES[(header or "").strip().lower()]
    except KeyError:
        raise ValueError(f"must be true or false, not {header[:40]!r}") from None
    return key_allows or asked
