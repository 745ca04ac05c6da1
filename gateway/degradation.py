"""The degradation ladder's first rung, pure: while the fleet is saturated (a request arriving would wait, or
passes only by the critical-first rule), a request of a class given a cap has its output allowance lowered to it,
so every answer in the batch ends sooner and the queue drains faster; the answer says so in `x-kvfleet-degraded`.
The last rung is shedding (admission.py). Nothing changes while the fleet has room."""

from __future__ import annotations

from collections.abc import Mapping

from kvfleet.fleet.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS
from kvfleet.fleet.priority import Priority

STEP_MAX_TOKENS = "max_tokens"  # the step's name in kvfleet_gateway_degraded_total and the answer's header


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
