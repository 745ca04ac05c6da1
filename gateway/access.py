"""Who may send and how much: the API key a request carries and its rpm/tpm admission, with the reservation that
settles the key's token count when the answer ends."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.usage import Settlement, request_cost


def authenticate(keys: Any | None, request_headers: Mapping[str, str]) -> Any | None:
    """The caller's key (gateway.auth.ApiKey), None when API keys are off; 401 without a valid one."""
    if keys is None:
        return None
    key = keys.authenticate_headers(request_headers)
    if key is None:
        raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")
    return key


async def admit_key(limiter: Any | None, key: Any | None, body: dict | None, metrics: GatewayMetrics,
                    run: Callable[[Coroutine], None]) -> Settlement | None:
    """Admits a request against its key's rpm/tpm, reserving its cost (429 with Retry-After when over); the
    Settlement settles the reservation at the end, through `run` (the relay's end is sync code)."""
    if key is None or limiter is None:
        return None
    cost = request_cost(body) if body is not None and getattr(key, "tpm", None) is not None else None
    verdict = await limiter.admit(key, cost.tokens if cost else 0)
    if not verdict.allowed:
        metrics.shed.labels("any", f"rate_limit_{verdict.reason}").inc()
        per = "requests" if verdict.reason == "rpm" else "tokens"
        raise APIError(429, f"API key {key.key_id} is over its {per}-per-minute limit; retry in "
                            f"{verdict.retry_after_s} s", "rate_limit_exceeded", code=f"{verdict.reason}_limit",
                       headers={headers.RETRY_AFTER: str(verdict.retry_after_s)})
    reservation = verdict.reservation
    if cost is None or reservation is None:
        return None
    return Settlement(cost, lambda actual: run(limiter.settle(reservation, actual)))


