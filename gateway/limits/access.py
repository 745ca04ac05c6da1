"""Who may send and how much: the API key a request carries, its tenant, its rpm/tpm admission, and the
settlement that corrects the key's token count and the tenant's fair-share charge when the answer ends."""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.limits.tenant_metrics import TenantMetrics
from kvfleet.gateway.limits.usage import Settlement
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.queue.order import DEFAULT_TENANT
from kvfleet.gateway.token_estimate import Cost, request_cost

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    """Whose share of the fleet queue a request uses: its API key's name, weight and caps, else the tenant header's
    (caps None: none)."""

    name: str
    weight: float = 1.0
    max_queued: int | None = None  # its requests waiting in the fleet queue, fleet-wide
    max_inflight: int | None = None  # its requests admitted and not finished (queued or at an engine), fleet-wide


def authenticate(keys: Any | None, request_headers: Mapping[str, str]) -> Any | None:
    """The caller's key (limits/keys.py's ApiKey), None when API keys are off; 401 without a valid one."""
    if keys is None:
        return None
    key = keys.authenticate_headers(request_headers)
    if key is None:
        raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")
    return key


def request_tenant(key: Any | None, request_headers: Mapping[str, str], max_queued: int | None = None,
                   max_inflight: int | None = None) -> Tenant:
    """The key's name when API keys are on (the header is ignored then: any client could claim any tenant);
    without keys the `x-kvfleet-tenant` header, unverified, else the default tenant. 400 for a malformed header.
    The caps are the key's where it sets them, else the ones given (the gateway's defaults)."""
    if key is not None:
        own_queued, own_inflight = getattr(key, "max_queued", None), getattr(key, "max_inflight", None)
        return Tenant(key.name, getattr(key, "weight", 1.0), max_queued if own_queued is None else own_queued,
                      max_inflight if own_inflight is None else own_inflight)
    given = request_headers.get(headers.TENANT)
    if given is None or given == "":
        return Tenant(DEFAULT_TENANT, max_queued=max_queued, max_inflight=max_inflight)
    if not TENANT_NAME.fullmatch(given):
        shown = given if len(given) <= 80 else given[:80] + "..."
        raise APIError(400, f"{headers.TENANT} must be 1 to 64 letters, digits, '.', '_' or '-' (such as "
                            f"'team-a'), not {shown!r}", param=headers.TENANT)
    return Tenant(given, max_queued=max_queued, max_inflight=max_inflight)


class TenantCharge:
    """A request's charge to its tenant's fair-share counter: its estimated tokens / weight when it is sent (by the
    queue's release, or here when it goes without queueing), corrected with the engine's count at its end."""

    def __init__(self, queue: Any, priority: Priority, tenant: Tenant, cost: Cost, run: Callable[[Coroutine], None]):
        self.queue, self.priority, self.tenant, self.cost, self._run = queue, priority, tenant, cost, run
        self.charged = False

    @property
    def amount(self) -> float:
        return self.cost.tokens / self.tenant.weight

    def sent_directly(self) -> None:
        self.charged = True
        self._run(self.queue.charge(self.priority, self.tenant.name, self.amount))

    def released(self) -> None:
        """Released from the fleet queue, which charged it then."""
        self.charged = True

    def settle(self, actual_tokens: int) -> None:
        if self.charged and actual_tokens != self.cost.tokens:
            correction = (actual_tokens - self.cost.tokens) / self.tenant.weight
            self._run(self.queue.charge(self.priority, self.tenant.name, correction))


async def admit_key(limiter: Any | None, key: Any | None, body: dict | None, metrics: GatewayMetrics,
                    run: Callable[[Coroutine], None], share: TenantCharge | None = None,
                    tenants: TenantMetrics | None = None) -> Settlement | None:
    """Admits a request against its key's rpm/tpm, reserving its cost (429 with Retry-After when over); the
    Settlement settles the reservation and corrects the tenant's charge (`share`) at the end, through `run`
    (the relay's end is sync code). A refusal counts for the key's tenant in `tenants`."""
    settles: list[Callable[[int], None]] = []
    cost = share.cost if share is not None else None
    if key is not None and limiter is not None:
        limit_cost = request_cost(body) if body is not None and getattr(key, "tpm", None) is not None else None
        verdict = await limiter.admit(key, limit_cost.tokens if limit_cost else 0)
        if not verdict.allowed:
            metrics.shed.labels("any", f"rate_limit_{verdict.reason}").inc()
            if tenants is not None:
                tenants.shed(key.name, f"rate_limit_{verdict.reason}")
            per = "requests" if verdict.reason == "rpm" else "tokens"
            raise APIError(429, f"API key {key.key_id} is over its {per}-per-minute limit; retry in "
                                f"{verdict.retry_after_s} s", "rate_limit_exceeded", code=f"{verdict.reason}_limit",
                           headers={headers.RETRY_AFTER: str(verdict.retry_after_s)})
        reservation = verdict.reservation
        if limit_cost is not None and reservation is not None:
            cost = limit_cost
            settles.append(lambda actual: run(limiter.settle(reservation, actual)))
    if share is not None:
        settles.append(share.settle)
    if cost is None or not settles:
        return None

    def settle_all(actual: int) -> None:
        for settle in settles:
            settle(actual)
    return Settlement(cost, settle_all)
