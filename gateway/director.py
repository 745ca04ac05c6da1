"""One request's path from its front to an engine, whatever carries its bytes (the Python proxy, or Envoy and the
endpoint picker): what its headers allow before its body is read (check_headers), the fleet its body names (a
front's `target`), its admission there (admit: the schema, rpm/tpm, the trust rule on priority, tenants' caps, the
verdict), its wait in the fleet queue (Admission.wait) and the engine it goes to (Admission.dispatch). A front
translates its wire into these calls and their answers back, and decides nothing; the Gateway Inference Extension's
director (requestcontrol/) has the same place between its ext_proc handler and its scheduler.

A client that leaves is the caller's to notice: it cancels the wait (the Python front on the connection's
http.disconnect, gRPC when Envoy resets the picker's stream), and the entry leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.openai_schema import RequestSchemaError, parse_json, validate_request
from kvfleet.fleet.priority import Priority, forwarded_engine_priority, parse_priority
from kvfleet.gateway.admission import Action, no_engine, queue_refusal, shed_refusal
from kvfleet.gateway.admission import admit as verdict_of
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.degradation import cap_output, header_value, output_cap, step_of
from kvfleet.gateway.limits.access import Tenant, TenantCharge, admit_key, authenticate, request_tenant
from kvfleet.gateway.limits.class_grant import class_ceiling, class_refusal
from kvfleet.gateway.limits.usage import Settlement, Usage, ask_stream_usage
from kvfleet.gateway.migration import continuable_body
from kvfleet.gateway.prefix.worth import PromptKeys
from kvfleet.gateway.queue.fleet import Outcome
from kvfleet.gateway.queue.wait import retry_after_s
from kvfleet.gateway.routing.pick import available, critical_room
from kvfleet.gateway.routing.router import Dispatch
from kvfleet.gateway.routing.strategies import PREFIX_STRATEGIES
from kvfleet.gateway.token_estimate import request_cost

if TYPE_CHECKING:
    from kvfleet.gateway.core import Gateway


def request_class(request_headers: Mapping[str, str]) -> Priority:
    """The class the client asks for (x-kvfleet-priority; standard without it); 400 for anything else."""
    try:
        return parse_priority(request_headers.get(headers.PRIORITY))
    except ValueError as err:
        raise APIError(400, str(err), param=headers.PRIORITY) from None


def max_queue_ms(config: GatewayConfig, header: str | None) -> float:
    """How long the request may wait in the fleet queue: its x-kvfleet-max-queue-ms, else the gateway's default."""
    if header is None or header == "":
        return config.default_max_queue_ms
    limit = config.max_queue_ms_limit
    try:
        value = float(header)
    except ValueError:
        value = -1.0
    if not 0 <= value <= limit:
        raise APIError(400, f"{headers.MAX_QUEUE_MS} must be a number of milliseconds from 0 to {limit:.0f}, "
                            f"not {header!r}", param=headers.MAX_QUEUE_MS)
    return value


@dataclass(frozen=True)
class Ticket:
    """What a request's headers decided before its body was read: its class (one it may claim), its key and tenant,
    how long it may wait in the queue, whether it may go to a fallback model, and when it arrived (its TTFT counts
    from then)."""

    priority: Priority
    key: object | None
    tenant: Tenant
    max_queue_ms: float
    may_fall_back: bool = False
    arrived_at: float = field(default_factory=time.monotonic)


def check_headers(config: GatewayConfig, keys: object | None, request_headers: Mapping[str, str],
                  priority: Priority, may_fall_back: bool = False) -> Ticket:
    """The checks a request's headers allow, before its body is read: the queue wait it asks for, its API key, the
    class it may claim (refused before any count: a refused claim is no arrival of its class), and its tenant."""
    arrived_at = time.monotonic()
    check_forwarded(request_headers)
    wait_ms = max_queue_ms(config, request_headers.get(headers.MAX_QUEUE_MS))
    key = authenticate(keys, request_headers)
    refusal = class_refusal(priority, class_ceiling(key, config.max_class), keys is not None)
    if refusal is not None:
        raise refusal
    tenant = request_tenant(key, request_headers, config.tenant_max_queued, config.tenant_max_inflight)
    return Ticket(priority, key, tenant, wait_ms, may_fall_back, arrived_at)


def check_forwarded(request_headers: Mapping[str, str]) -> None:
    """400 for a header the engine would get (headers.FORWARDED) whose value is not visible ASCII: the bytes a front
    decodes as latin-1 could not be sent on, and the request would fail at the engine's door instead."""
    for name in headers.FORWARDED:
        value = request_headers.get(name)
        if value is not None and not (value.isascii() and value.isprintable()):
            raise APIError(400, f"the {name} header must be visible ASCII characters only; send it without the "
                                f"bytes outside ASCII, or leave it out", param=name)


def check_body(path: str, raw: bytes) -> dict:
    """The body as JSON, checked against the engines' own strict schema: a body they would refuse never waits in
    the queue or costs a retry."""
    try:
        body = parse_json(raw)
        validate_request(path, body)
    except RequestSchemaError as err:
        raise APIError(400, err.message, param=err.param) from None
    return body


@dataclass(frozen=True)
class Target:
    """The fleet a request goes to, and its body as that fleet's engines take it (`renamed`: its model was an
    alias or the fallback's, so the body is sent re-encoded; `degraded`: the ladder's step taken to get here)."""

    gateway: Gateway
    path: str
    raw: bytes
    body: dict
    renamed: bool = False
    degraded: str | None = None


@dataclass(eq=False)
class Admission:
    """A request its fleet let through: the body to send (rewritten when `changed`), its prompt's block hashes, the
    token reservation to settle. `queued`: it waits its turn in the fleet queue first (wait()). Once waited it goes to
    an engine even if they all look saturated by then: the fleet had room when it was admitted, or the queue
    released it."""

    gateway: Gateway
    ticket: Ticket
    body: bytes
    changed: bool
    hashes: PromptKeys
    settlement: Settlement | None
    degraded: str | None
    queued: bool
    share: TenantCharge | None
    has_capacity: bool
    continuable: bool = False  # a stream the engine sends its token ids in: migration.py can continue it elsewhere
    hide_token_ids: bool = False  # the gateway asked for them, the client did not: they are taken out of its answer

    @property
    def priority(self) -> Priority:
        return self.ticket.priority

    async def wait(self) -> None:
        """Its turn in the fleet queue, when it must wait for one: APIError at its deadline or when the queue would
        not take it; cancelled when its client leaves (the entry leaves the queue). Nothing when it was not
        queued."""
        if self.queued:
            try:
                await _wait_in_queue(self)
            except BaseException:
                self.refund()
                raise
            self.queued = False
        elif self.share is not None:
            self.share.sent_directly()
            self.share = None
        if self.degraded is not None:  # counted once it goes to an engine, not if its wait in the queue ran out
            self.gateway.metrics.degraded.labels(self.priority.value, step_of(self.degraded)).inc()

    def dispatch(self, exclude: frozenset[str] = frozenset(), fallbacks: int = 0) -> Dispatch:
        """The engine it goes to now (and up to `fallbacks` more for a retry elsewhere), none of `exclude`, with the
        dispatch recorded; no_engine (the reservation refunded) when no engine may serve it."""
        pick = self.gateway.router.dispatch(self.hashes, exclude, self.priority is Priority.CRITICAL, fallbacks)
        if pick is None:
            raise self.no_engine()
        return pick

    def no_engine(self, detail: str = "no engine is available", status: int = 503) -> APIError:
        """The answer when no engine will serve it after all; nothing was generated, so its reservation goes."""
        self.refund()
        return no_engine(detail, status)

    def refund(self) -> None:
        if self.settlement is not None:
            self.settlement.refund()


async def admit(ticket: Ticket, target: Target, stream_usage: bool = True, continuable: bool = False) -> Admission:
    """Everything a request's fleet decides before it goes to an engine: the strict schema (done by the target),
    rpm/tpm, the trust rule on priority, its tenant's caps, and the admission verdict (go now, wait in the queue, or
    a refusal: APIError). `stream_usage` False: nothing will read a stream's usage chunk (an Envoy without
    kvfleet's Lua filter), so the engine is not asked for it. `continuable`: the front can continue a stream its
    engine drops (migration.py), so a stream of one choice asks its engine for the token ids that takes."""
    gateway, body, priority, tenant = target.gateway, target.body, ticket.priority, ticket.tenant
    config = gateway.config
    gateway.tenant_metrics.arrived(tenant.name)
    adapter = gateway.adapters.adapter_of(body.get("model")) if gateway.adapters else None
    hashes = (gateway.prefix.keys(target.path, body, adapter) if config.routing in PREFIX_STRATEGIES
              else PromptKeys([], adapter=adapter))
    share = TenantCharge(gateway.queue, priority, tenant, request_cost(body), gateway.run_in_background) \
        if config.queue_policy == "fair" else None
    settlement = await admit_key(gateway.limiter, ticket.key, body, gateway.metrics, gateway.run_in_background,
                                 share, gateway.tenant_metrics)
    settlement = gateway.tenant_metrics.counted(tenant.name, settlement, body)  # served tokens, whatever the policy
    gateway.slo_counts.arrived(priority, settlement.cost.prompt)
    settlement.when_answered(functools.partial(gateway.slo_counts.answered, priority, ticket.arrived_at))
    if adapter is not None:
        settlement.when_answered(functools.partial(_adapter_tokens, gateway, adapter))
    # the trust rule (kvfleet.fleet.priority): a body's priority reaches the engine only from a trusted key
    under_share = config.queue_policy == "fair" and gateway.shares.under_share(tenant.name)
    engine_priority = forwarded_engine_priority(priority, body.get("priority"),
                                                getattr(ticket.key, "allow_priority", False),
                                                config.forward_priority, under_share)
    settlement.when_finished(gateway.shares.start(tenant.name))
    changed = engine_priority != body.get("priority")
    if changed and engine_priority is None:
        del body["priority"]
    elif changed:
        body["priority"] = engine_priority  # the engine admits and preempts by it too
    if stream_usage and ask_stream_usage(body):
        settlement.hide_stream_usage = changed = True  # the count comes from the usage chunk, hidden again
    continuable = continuable and continuable_body(body)
    hide_token_ids = continuable and body.get("return_token_ids") is not True
    if hide_token_ids:
        body["return_token_ids"] = changed = True
    changed = changed or target.renamed
    degraded = target.degraded
    try:
        await _take_in_flight_slot(gateway, tenant, priority, settlement)
        snapshots = gateway.pool.snapshots()
        reserved = frozenset() if priority is Priority.CRITICAL else gateway.router.reserved(snapshots)
        has_capacity = bool(available([e for e in snapshots if e.url not in reserved], config.saturation))
        critical_has_room = (priority is Priority.CRITICAL and config.critical_first
                             and bool(critical_room(snapshots, config.saturation)))
        counts = gateway.queue.counts()
        verdict = verdict_of(priority, has_capacity, sum(counts.values()), counts[priority],
                             config.queue_caps[priority], critical_has_room)
        if verdict.action is Action.SHED:
            raise _shed(gateway, priority, verdict.reason, verdict.message, tenant)
        saturated = not (has_capacity and sum(counts.values()) == 0)  # it waits, or passes by critical-first
        cap = output_cap(priority, saturated, config.degrade_max_tokens)
        if cap is not None and cap_output(target.path, body, cap):
            changed, degraded = True, header_value(cap)
    except BaseException:
        settlement.refund()  # refused or shed: nothing was generated
        raise
    raw = json.dumps(body).encode() if changed else target.raw
    return Admission(gateway, ticket, raw, changed, hashes, settlement, degraded, verdict.action is Action.QUEUE,
                     share, has_capacity, continuable, hide_token_ids)


async def _wait_in_queue(admission: Admission) -> None:
    gateway, ticket, share = admission.gateway, admission.ticket, admission.share
    tenant = ticket.tenant
    priority = ticket.priority
    entry, placement = await gateway.queue.place(priority, ticket.max_queue_ms, tenant.name,
                                                 share.amount if share else 0.0, tenant.max_queued)
    if not placement.queued:
        reason, error = queue_refusal(priority, tenant.name, placement, gateway.queue.drain_rate_per_s(),
                                      ticket.max_queue_ms, gateway.config.queue_caps[priority],
                                      gateway.queue.total())
        _count_shed(gateway, priority, reason, tenant)
        raise error
    if gateway.scraper is not None:  # engines read slowly while quiet are read at once: their room releases this one
        gateway.scraper.wake()
    if admission.has_capacity:
        gateway.poke()
    started = time.monotonic()
    gateway.tenant_metrics.queued(tenant.name, +1)
    try:
        outcome = await gateway.queue.wait(entry)
    except asyncio.CancelledError:  # its client left while it waited
        _count_shed(gateway, priority, "disconnected", tenant, slo=False)
        raise
    finally:
        gateway.tenant_metrics.queued(tenant.name, -1)
    waited = time.monotonic() - started
    gateway.metrics.queue_wait.labels(priority.value).observe(waited)
    gateway.tenant_metrics.waited(tenant.name, waited)
    if outcome is Outcome.EXPIRED:
        _count_shed(gateway, priority, "deadline", tenant)
        raise APIError(503, f"the fleet stayed saturated for {ticket.max_queue_ms:.0f} ms, the longest this request "
                            f"may wait ({headers.MAX_QUEUE_MS}); retry later", "service_unavailable",
                       code="queue_timeout", headers={headers.RETRY_AFTER: str(retry_after(gateway))})
    if share is not None:
        share.released()


def retry_after(gateway: Gateway) -> int:
    """When to come back: once the fleet queue now waiting has drained at its measured rate."""
    return retry_after_s(gateway.queue.total(), gateway.queue.drain_rate_per_s())


def _shed(gateway: Gateway, priority: Priority, reason: str, message: str, tenant: Tenant | None = None,
          retry_after_seconds: int | None = None) -> APIError:
    _count_shed(gateway, priority, reason, tenant)
    return shed_refusal(reason, message, retry_after(gateway) if retry_after_seconds is None else retry_after_seconds)


def _count_shed(gateway: Gateway, priority: Priority, reason: str, tenant: Tenant | None, slo: bool = True) -> None:
    gateway.metrics.shed.labels(priority.value, reason).inc()
    if slo:
        gateway.slo_counts.shed(priority)
    if tenant is not None:
        gateway.tenant_metrics.shed(tenant.name, reason)


async def _take_in_flight_slot(gateway: Gateway, tenant: Tenant, priority: Priority, settlement: Settlement) -> None:
    """Counts the request against its tenant's max_inflight until it ends; 429 with Retry-After at the cap."""
    if tenant.max_inflight is None:
        return
    slot = await gateway.in_flight.acquire(tenant.name, tenant.max_inflight)
    if slot is None:
        wait = gateway.in_flight.retry_after_s(tenant.max_inflight)
        raise _shed(gateway, priority, "tenant_inflight_full", f"tenant {tenant.name!r} already has "
                    f"{tenant.max_inflight} requests admitted and unfinished, the most it may (max_inflight); "
                    f"retry in {wait} s", tenant, retry_after_seconds=wait)
    settlement.when_finished(slot.release)


def _adapter_tokens(gateway: Gateway, adapter: str, usage: Usage) -> None:
    """An adapter's answer's tokens, as the engine counted them (an answer without a count adds nothing)."""
    if usage.total is None:
        return
    completion = usage.completion or 0
    m = gateway.metrics
    m.labelled(m.lora_tokens, adapter, "prompt").inc(max(0, usage.total - completion))
    m.labelled(m.lora_tokens, adapter, "completion").inc(completion)
