"""The HTTP header names of the fleet's contract (ARCHITECTURE.md's "Request headers"), each written once.

Lower case, as ASGI servers and httpx hand them over.
"""

from __future__ import annotations

from collections.abc import Iterable

# Sent by clients to the gateway.
REQUEST_ID = "x-request-id"  # kept when the client sends one, made otherwise; echoed on the answer
PRIORITY = "x-kvfleet-priority"  # critical | standard | sheddable (kvfleet.fleet.priority)
MAX_QUEUE_MS = "x-kvfleet-max-queue-ms"  # the longest wait in the gateway's queue
TENANT = "x-kvfleet-tenant"  # the fair-share tenant where no API keys are configured (unverified; ignored with keys)
AUTHORIZATION = "authorization"  # `Bearer <key>`: the client's API key, or the gateway's engine key
ALLOW_FALLBACK = "x-kvfleet-allow-fallback"  # `true`: the request may be served by its model's fallback model
API_KEY = "x-api-key"  # the raw key, for clients that cannot send a bearer token
# The client's headers the gateway passes on to the engine (no credentials, cookies or hop-by-hop headers): their
# values must be visible ASCII, as an HTTP client sends them (a 400 at the gateway otherwise).
FORWARDED = frozenset(("content-type", "accept", "traceparent", "tracestate"))

# Set on answers.
ENGINE = "x-kvfleet-engine"  # the engine that served, set by the gateway
FAULT = "x-kvfleet-fault"  # `engine` on an engine's 5xx that is its own fault, so a gateway retries elsewhere
ENGINE_FAULT = "engine"  # FAULT's value
RETRY_AFTER = "retry-after"  # seconds, on 429 and 503
DEGRADED = "x-kvfleet-degraded"  # the degradation step applied to this answer, e.g. `max_tokens=256`


def combined(fields: Iterable[tuple[bytes | str, bytes | str]]) -> dict[str, str]:
    """The one view of a request's headers that every check reads and the engine is sent, on either data plane:
    names lower case, values as latin-1 text, and a field sent on several lines combined into one, its values
    joined by ", " in the order sent (RFC 9110 section 5.3), so no check reads one line while another is sent on."""
    out: dict[str, str] = {}
    for name, value in fields:
        key = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out
