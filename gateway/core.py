"""The gateway's decision core, whatever carries the bytes (the Python proxy or Envoy's picker): one fleet's engines,
queue, limits and background tasks, and everything decided before a request goes to an engine (admission.py's
verdict, waits in the fleet queue, refusals)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field

import httpx
from fastapi.responses import Response
from prometheus_client import generate_latest

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.openai_schema import RequestSchemaError, parse_json, validate_request
from kvfleet.fleet.priority import Priority, forwarded_engine_priority
from kvfleet.gateway.admission import Action, admit, queue_refusal, shed_refusal
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.degradation import cap_output, header_value, output_cap, step_of
from kvfleet.gateway.engines.adapters import ServedAdapters
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.engines.scraper import Scraper
from kvfleet.gateway.limits.access import Tenant, TenantCharge, admit_key, authenticate, request_tenant
from kvfleet.gateway.limits.class_grant import class_ceiling, class_refusal
from kvfleet.gateway.limits.tenant_caps import TenantInFlight
from kvfleet.gateway.limits.tenant_metrics import TenantMetrics
from kvfleet.gateway.limits.tenant_share import InFlightShares
from kvfleet.gateway.limits.usage import Settlement, Usage, ask_stream_usage, request_cost
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.models.routes import ModelRoute
from kvfleet.gateway.prefix.events_sse import KVEventFollower
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys, Tokenize
from kvfleet.gateway.proxy import Forwarder
from kvfleet.gateway.queue.fleet import FleetQueue, Outcome
from kvfleet.gateway.queue.order import Placement
from kvfleet.gateway.queue.wait import retry_after_s
from kvfleet.gateway.routing.pick import available, critical_room, free_slots
from kvfleet.gateway.routing.router import Router
from kvfleet.gateway.routing.strategies import PREFIX_STRATEGIES
from kvfleet.gateway.slo_counts import SloCounts

log = logging.getLogger("kvfleet.gateway")


@dataclass(frozen=True)
class Admitted:
    """A request the gateway let through: the body to send (rewritten when `changed`), its prompt's block hashes,
    and the token reservation to settle. It goes to an engine even if they all look saturated by the time it is
    routed: the fleet had room when it was admitted, or it was released from the queue."""

    body: bytes
    changed: bool
    hashes: PromptKeys
    settlement: Settlement | None
    degraded: str | None = None  # the ladder's step applied (headers.DEGRADED's value), None when served as asked


@dataclass
class Gateway:
    """Everything one gateway replica holds; built by `build_app`, started and stopped by its lifespan."""

    config: GatewayConfig
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    pool: EndpointPool = field(init=False)
    tokenize: Tokenize | None = None  # the engines' tokenizer (kvfleet/prompt_tokens.py): the precise prefix index
    prefix: PrefixRouting = field(init=False)
    kv_events: KVEventFollower | None = None
    client: httpx.AsyncClient | None = None
    queue: FleetQueue | None = None
    scraper: Scraper | None = None
    adapters: ServedAdapters | None = None  # which adapters each engine serves (engines with the LoRA gauge)
    router: Router | None = None
    forwarder: Forwarder | None = None
    discovery: object | None = None
    keys: object | None = None  # gateway.auth.ApiKeyStore when API keys are on
    limiter: object | None = None  # gateway.rate_limit.RateLimiter when per-key limits are on
    in_flight: TenantInFlight | None = None  # tenants' admitted, unfinished requests (their max_inflight caps)
    shares: InFlightShares = field(default_factory=InFlightShares)  # this replica's, for the engines' priority
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _release_task: asyncio.Task | None = None
    tenant_metrics: TenantMetrics = field(init=False)
    slo_counts: SloCounts = field(init=False)  # per class, for the operator (Redis; none without it)
    route: ModelRoute | None = None  # the model it serves behind a ModelFront (gateway/models/front.py)

    def __post_init__(self) -> None:
        self.pool = EndpointPool(self.config.eject_after_failures, self.config.eject_seconds)
        self.slo_counts = SloCounts(None, self.config.fleet)
        self.prefix = PrefixRouting(self.tokenize)
        self.tenant_metrics = TenantMetrics(self.metrics, self.config.tenant_metrics_top)
        # Envoy's modes: False until the endpoint picker listens (the app starts first: its startup starts what the
        # picker needs) and again once it drains; /ready is 503 meanwhile. None: no picker in this process.
        self.picker_serving: bool | None = None if self.config.data_plane == "python" else False

    # ---- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=c.upstream_connect_timeout_s),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512, keepalive_expiry=30.0))
        self.queue = FleetQueue(c.redis_url, c.fleet, c.gateway_id, c.aging_ms, c.queue_caps,
                                on_backend_change=lambda up: self.metrics.redis_up.set(1 if up else 0),
                                policy=c.queue_policy)
        self.queue.release_window_ms = max(1, round(c.scrape_interval_s * 1000))
        await self.queue.start()
        self.metrics.redis_up.set(1 if self.queue.using_redis else 0)
        self.in_flight = TenantInFlight(self.queue.client, c.fleet, c.gateway_id)
        self._tasks.append(asyncio.create_task(self.in_flight.renew_forever(), name="tenant in-flight leases"))
        self.slo_counts.client = self.queue.client
        self._tasks.append(asyncio.create_task(self.slo_counts.flush_forever(), name="SLO counts"))
        if self.keys is not None and self.limiter is None:
            from kvfleet.gateway.limits.rate_limit import InProcessRateLimiter, RateLimiter

            self.limiter = RateLimiter(self.queue.client, c.fleet) if self.queue.client else InProcessRateLimiter()
        self.router = Router(c, self.pool, self.prefix, self.metrics)
        self.forwarder = Forwarder(c, self.client, self.router)
        self.adapters = ServedAdapters(self.pool, c.engine_api_key)
        self.scraper = Scraper(self.pool, c.scrape_interval_s, on_scrape=self._scraped,
                               unreachable_after_s=c.engine_unreachable_after_s)
        if self.tokenize is not None and c.routing in PREFIX_STRATEGIES:  # without tokens, no index lookups
            self.kv_events = KVEventFollower(self.pool, self.prefix.index, self.metrics, c.engine_api_key)
        self.discovery = self.discovery or _discovery(c)
        self._tasks.append(asyncio.create_task(self.discovery.run(self.set_endpoints), name="discovery"))
        self._tasks.append(asyncio.create_task(self._release_ticker(), name="release ticker"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.scraper:
            await self.scraper.stop()
        if self.adapters:
            await self.adapters.stop()
        if self.kv_events:
            await self.kv_events.stop()
        if self.in_flight:
            await self.in_flight.stop()
        await self.slo_counts.flush()  # the last second's counts
        if self.queue:
            await self.queue.stop()
        if self.client:
            await self.client.aclose()

    def set_endpoints(self, urls: frozenset[str]) -> None:
        added, removed = self.pool.set_urls(urls)
        for url in removed:
            self.prefix.forget(url)
        if added or removed:
            log.info("engines: %d (+%s -%s)", len(self.pool.endpoints), sorted(added), sorted(removed))
        self.scraper.sync()
        if self.kv_events:
            self.kv_events.sync()

    def _scraped(self, url: str) -> None:
        if self.adapters:
            self.adapters.sync()  # an engine that turned out to serve adapters is asked which
        self.poke()

    # ---- releasing queued requests --------------------------------------------------------------------------
    def poke(self) -> None:
        """New load figures arrived: release queued requests if there is room (one pass at a time)."""
        if self._release_task is None or self._release_task.done():
            self._release_task = asyncio.create_task(self._release_pass())

    async def _release_ticker(self) -> None:
        """Releases also happen without scrapes (no engines yet, other replicas' entries), at a slower beat."""
        while True:
            await asyncio.sleep(0.25)
            self.poke()

    async def _release_pass(self) -> None:
        total = await self.queue.refresh_counts()
        for p, n in self.queue.counts().items():
            self.metrics.queue_depth.labels(p.value).set(n)
        self.metrics.queue_drain_rate.set(self.queue.drain_rate_per_s() or 0.0)
        if total == 0:
            return
        snapshots = self.pool.snapshots()
        reserved = self.router.reserved(snapshots)  # the queue's requests do not go to the critical lane
        slots = free_slots([e for e in snapshots if e.url not in reserved], self.config.saturation)
        if slots == 0:
            return
        for _, owner in await self.queue.release(min(slots, total)):
            if owner != self.config.gateway_id:  # another replica sends it; count it where it will likely go
                url = self.router.choose(PromptKeys([]), must=True)
                if url is not None:
                    self.pool.record_expected(url)

    # ---- one request --------------------------------------------------------------------------------------
    async def admit(self, path: str, request_headers: Mapping[str, str], read_body: Callable[[], Awaitable[bytes]],
                    priority: Priority, is_disconnected: Callable[[], Awaitable[bool]],
                    on_queue: Callable[[float], Awaitable[None]] | None = None, stream_usage: bool = True,
                    on_fleet: Callable[[Gateway], None] | None = None) -> tuple[Gateway, Admitted]:
        """The fleet that will serve the request and its admission (one fleet here; gateway/models/front.py chooses
        among several by `model`). `on_fleet` learns the fleet once it is known, before any refusal of its own."""
        if on_fleet is not None:
            on_fleet(self)
        return self, await self.admit_request(path, request_headers, read_body, priority, is_disconnected, on_queue,
                                              stream_usage)

    def has_room(self) -> bool:
        """Whether a request arriving now would go to an engine at once (nobody waits, an engine has room)."""
        return self.queue.total() == 0 and bool(available(self.pool.snapshots(), self.config.saturation))

    async def admit_request(self, path: str, request_headers: Mapping[str, str],
                            read_body: Callable[[], Awaitable[bytes]], priority: Priority,
                            is_disconnected: Callable[[], Awaitable[bool]],
                            on_queue: Callable[[float], Awaitable[None]] | None = None,
                            stream_usage: bool = True, parsed: dict | None = None, rewritten: bool = False,
                            degraded: str | None = None) -> Admitted:
        """Everything the gateway decides before a request goes to an engine, whatever carries its bytes (this
        proxy or Envoy): the key, the class it may claim, the strict schema, rpm/tpm, the trust rule on priority,
        and the admission verdict with its wait in the fleet queue. APIError for a refusal or a shed;
        `on_queue(max_queue_ms)` is told before a wait in the queue. The body is read only once the headers pass.
        `stream_usage` False: nothing will read a stream's usage chunk (an Envoy without kvfleet's Lua filter), so
        the engine is not asked for it. `parsed`: the body, already parsed and checked (read_body still gives its
        bytes); `rewritten`: the caller changed it (its model), so it is sent re-encoded; `degraded`: the ladder's
        step the caller took (a fallback model), on the answer and in the metrics."""
        arrived_at = time.monotonic()  # its time to first token counts from here
        max_queue_ms = self._max_queue_ms(request_headers.get(headers.MAX_QUEUE_MS))
        key = authenticate(self.keys, request_headers)
        # before any count: a refused claim is no arrival of its class (SLO counts, tenants, the queue)
        refusal = class_refusal(priority, class_ceiling(key, self.config.max_class), self.keys is not None)
        if refusal is not None:
            raise refusal
        tenant = request_tenant(key, request_headers, self.config.tenant_max_queued, self.config.tenant_max_inflight)
        self.tenant_metrics.arrived(tenant.name)
        raw = await read_body()
        body = check_body(path, raw) if parsed is None else parsed
        adapter = self.adapters.adapter_of(body.get("model")) if self.adapters else None
        hashes = (self.prefix.keys(path, body, adapter) if self.config.routing in PREFIX_STRATEGIES
                  else PromptKeys([], adapter=adapter))
        share = TenantCharge(self.queue, priority, tenant, request_cost(body), self._run_in_background) \
            if self.config.queue_policy == "fair" else None
        settlement = await self._limit(key, body, share)
        settlement = self.tenant_metrics.counted(tenant.name, settlement, body)  # served tokens, whatever the policy
        self.slo_counts.arrived(priority, settlement.cost.prompt)
        settlement.when_answered(functools.partial(self.slo_counts.answered, priority, arrived_at))
        if adapter is not None:
            settlement.when_answered(functools.partial(self._adapter_tokens, adapter))
        # the trust rule (kvfleet.fleet.priority): a body's priority reaches the engine only from a trusted key
        under_share = self.config.queue_policy == "fair" and self.shares.under_share(tenant.name)
        engine_priority = forwarded_engine_priority(priority, body.get("priority"),
                                                    getattr(key, "allow_priority", False),
                                                    self.config.forward_priority, under_share)
        settlement.when_finished(self.shares.start(tenant.name))
        changed = engine_priority != body.get("priority")
        if changed and engine_priority is None:
            del body["priority"]
        elif changed:
            body["priority"] = engine_priority  # the engine admits and preempts by it too
        if settlement is not None and stream_usage and ask_stream_usage(body):
            settlement.hide_stream_usage = changed = True  # the count comes from the usage chunk, hidden again
        changed = changed or rewritten
        try:
            await self._take_in_flight_slot(tenant, priority, settlement)
            snapshots = self.pool.snapshots()
            reserved = frozenset() if priority is Priority.CRITICAL else self.router.reserved(snapshots)
            has_capacity = bool(available([e for e in snapshots if e.url not in reserved], self.config.saturation))
            critical_has_room = (priority is Priority.CRITICAL and self.config.critical_first
                                 and bool(critical_room(snapshots, self.config.saturation)))
            counts = self.queue.counts()
            verdict = admit(priority, has_capacity, sum(counts.values()), counts[priority],
                            self.config.queue_caps[priority], critical_has_room)
            if verdict.action is Action.SHED:
                raise self._shed(priority, verdict.reason, verdict.message, tenant)
            saturated = not (has_capacity and sum(counts.values()) == 0)  # it waits, or passes by critical-first
            cap = output_cap(priority, saturated, self.config.degrade_max_tokens)
            if cap is not None and cap_output(path, body, cap):
                changed, degraded = True, header_value(cap)
            if verdict.action is Action.QUEUE:
                if on_queue is not None:
                    await on_queue(max_queue_ms)
                await self._wait_in_queue(is_disconnected, priority, max_queue_ms, has_capacity, tenant, share)
            elif share is not None:
                share.sent_directly()
        except BaseException:
            if settlement is not None:
                settlement.refund()  # refused, shed or timed out in the queue: nothing was generated
            raise
        if degraded is not None:  # counted once it goes to an engine, not if its wait in the queue ran out
            self.metrics.degraded.labels(priority.value, step_of(degraded)).inc()
        if changed:
            raw = json.dumps(body).encode()
        return Admitted(raw, changed, hashes, settlement, degraded)

    def _adapter_tokens(self, adapter: str, usage: Usage) -> None:
        """An adapter's answer's tokens, as the engine counted them (an answer without a count adds nothing)."""
        if usage.total is None:
            return
        completion = usage.completion or 0
        m = self.metrics
        m.labelled(m.lora_tokens, adapter, "prompt").inc(max(0, usage.total - completion))
        m.labelled(m.lora_tokens, adapter, "completion").inc(completion)

    async def _wait_in_queue(self, is_disconnected: Callable[[], Awaitable[bool]], priority: Priority,
                             max_queue_ms: float, has_capacity: bool, tenant: Tenant,
                             share: TenantCharge | None) -> None:
        entry, placement = await self.queue.place(priority, max_queue_ms, tenant.name,
                                                  share.amount if share else 0.0, tenant.max_queued)
        if not placement.queued:
            raise self._not_queued(priority, tenant, placement, max_queue_ms)
        if has_capacity:
            self.poke()
        started = time.monotonic()
        self.tenant_metrics.queued(tenant.name, +1)
        try:
            outcome = await self.queue.wait(entry, is_disconnected)
        except asyncio.CancelledError:  # the picker's stream was reset: its client left while queued
            self.metrics.shed.labels(priority.value, "disconnected").inc()
            self.tenant_metrics.shed(tenant.name, "disconnected")
            raise
        finally:
            self.tenant_metrics.queued(tenant.name, -1)
        waited = time.monotonic() - started
        self.metrics.queue_wait.labels(priority.value).observe(waited)
        self.tenant_metrics.waited(tenant.name, waited)
        if outcome is Outcome.EXPIRED:
            self.metrics.shed.labels(priority.value, "deadline").inc()
            self.slo_counts.shed(priority)
            self.tenant_metrics.shed(tenant.name, "deadline")
            raise APIError(503, f"the fleet stayed saturated for {max_queue_ms:.0f} ms, the longest this request "
                                f"may wait ({headers.MAX_QUEUE_MS}); retry later", "service_unavailable",
                           code="queue_timeout", headers={headers.RETRY_AFTER: str(self._retry_after())})
        if outcome is Outcome.DISCONNECTED:
            self.metrics.shed.labels(priority.value, "disconnected").inc()
            self.tenant_metrics.shed(tenant.name, "disconnected")
            raise APIError(499, "the client closed the connection while queued", code="client_closed")
        if share is not None:
            share.released()

    def _shed(self, priority: Priority, reason: str, message: str, tenant: Tenant | None = None,
              retry_after: int | None = None) -> APIError:
        self._count_shed(priority, reason, tenant)
        return shed_refusal(reason, message, self._retry_after() if retry_after is None else retry_after)

    def _count_shed(self, priority: Priority, reason: str, tenant: Tenant | None) -> None:
        self.metrics.shed.labels(priority.value, reason).inc()
        self.slo_counts.shed(priority)
        if tenant is not None:
            self.tenant_metrics.shed(tenant.name, reason)

    def _not_queued(self, priority: Priority, tenant: Tenant, placement: Placement, max_queue_ms: float) -> APIError:
        """The answer to a request the fleet queue would not take (admission.queue_refusal), counted as shed."""
        reason, error = queue_refusal(priority, tenant.name, placement, self.queue.drain_rate_per_s(), max_queue_ms,
                                      self.config.queue_caps[priority], self.queue.total())
        self._count_shed(priority, reason, tenant)
        return error

    async def _take_in_flight_slot(self, tenant: Tenant, priority: Priority, settlement: Settlement) -> None:
        """Counts the request against its tenant's max_inflight until it ends; 429 with Retry-After at the cap."""
        if tenant.max_inflight is None:
            return
        slot = await self.in_flight.acquire(tenant.name, tenant.max_inflight)
        if slot is None:
            wait = self.in_flight.retry_after_s(tenant.max_inflight)
            raise self._shed(priority, "tenant_inflight_full", f"tenant {tenant.name!r} already has "
                             f"{tenant.max_inflight} requests admitted and unfinished, the most it may "
                             f"(max_inflight); retry in {wait} s", tenant, retry_after=wait)
        settlement.when_finished(slot.release)

    def _retry_after(self) -> int:
        return retry_after_s(self.queue.total(), self.queue.drain_rate_per_s())

    def _max_queue_ms(self, header: str | None) -> float:
        if header is None or header == "":
            return self.config.default_max_queue_ms
        limit = self.config.max_queue_ms_limit
        try:
            value = float(header)
        except ValueError:
            value = -1.0
        if not 0 <= value <= limit:
            raise APIError(400, f"{headers.MAX_QUEUE_MS} must be a number of milliseconds from 0 to {limit:.0f}, "
                                f"not {header!r}", param=headers.MAX_QUEUE_MS)
        return value

    async def _limit(self, key: object | None, body: dict | None,
                     share: TenantCharge | None = None) -> Settlement | None:
        return await admit_key(self.limiter, key, body, self.metrics, self._run_in_background, share,
                               self.tenant_metrics)

    def _run_in_background(self, work: Coroutine) -> None:
        """A Redis write started from sync code (the relay's end), awaited at stop."""
        task = asyncio.create_task(work)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def models_response(self, request_headers: Mapping[str, str]) -> Response:
        """GET /v1/models: the key checked and counted, then an engine's own list."""
        await self._limit(authenticate(self.keys, request_headers), None)
        upstream, url = await self.engine_models()
        return Response(upstream.content, upstream.status_code, media_type="application/json",
                        headers={headers.ENGINE: url})

    async def engine_models(self) -> tuple[httpx.Response, str]:
        """An engine's GET /v1/models answer, and the engine; 503 while none is available, 502 if it fails."""
        url = self.router.choose(PromptKeys([]), must=True)
        if url is None:
            raise APIError(503, "no engine is available yet; retry shortly", "service_unavailable",
                           code="no_engine", headers={headers.RETRY_AFTER: "1"})
        try:
            key = self.config.engine_api_key
            upstream = await self.client.get(f"{url}/v1/models", timeout=5.0,
                                             headers={headers.AUTHORIZATION: f"Bearer {key}"} if key else None)
        except httpx.HTTPError as err:
            raise APIError(502, f"engine {url} failed: {type(err).__name__}", "server_error") from err
        return upstream, url

    async def batch_models(self) -> dict[str, tuple[Gateway, str]]:
        """The models a batch line may name (the engines' list: the base model and its adapters), each served here
        under its own name."""
        upstream, _ = await self.engine_models()
        upstream.raise_for_status()
        data = upstream.json().get("data")
        return {m["id"]: (self, m["id"]) for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)} \
            if isinstance(data, list) else {}

    # ---- status -------------------------------------------------------------------------------------------
    def ready_body(self) -> dict:
        snaps = self.pool.snapshots()
        body = {"status": "ready", "engines": len(snaps), "healthy": sum(e.healthy for e in snaps),
                "available": len(available(snaps, self.config.saturation)), "queue": self.queue.backend,
                "queued": self.queue.total(), "critical_pending": sum(e.critical_pending for e in snaps)}
        if self.config.critical_lane:
            body["critical_lane"] = sorted(self.router.reserved(snaps))  # empty while no critical request came
        if self.queue.redis_error:
            body["redis"] = self.queue.redis_error
        if self.picker_serving is False:
            body["status"] = "picker not serving"
        return body

    def render_metrics(self) -> bytes:
        self.refresh_gauges()
        return generate_latest(self.metrics.registry)

    def refresh_gauges(self) -> None:
        self.tenant_metrics.refresh()  # a tenant that stopped sending is demoted even while nobody sends
        snaps = self.pool.snapshots()
        policy = self.config.saturation
        states = {"available": 0, "saturated": 0, "unhealthy": 0}
        for e in snaps:
            states["unhealthy" if not e.healthy else "saturated" if policy.is_saturated(e) else "available"] += 1
            self.metrics.scrape_age.labels(e.url).set(min(e.metrics_age_s, 1e9))
            self.metrics.scrape_interval.labels(e.url).set(e.scrape_interval_s)
        for state, n in states.items():
            self.metrics.endpoints.labels(state).set(n)


def _discovery(config: GatewayConfig):
    from kvfleet.gateway.engines.discovery import KubernetesDiscovery, StaticDiscovery

    if config.k8s_selector:
        return KubernetesDiscovery(config.k8s_namespace, config.k8s_selector, config.k8s_port_name)
    return StaticDiscovery(config.engines)


def check_body(path: str, raw: bytes) -> dict:
    """The body as JSON, checked against the engines' own strict schema: a body they would refuse never waits in
    the queue or costs a retry."""
    try:
        body = parse_json(raw)
        validate_request(path, body)
    except RequestSchemaError as err:
        raise APIError(400, err.message, param=err.param) from None
    return body


def request_id_from(given: str | None) -> str:
    """The client's x-request-id when it is short and printable, else a new one."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex
