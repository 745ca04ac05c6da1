"""One fleet as the gateway holds it, whatever carries the bytes (the Python proxy or Envoy's picker): its engines,
queue, limits, router and background tasks, the releases from its queue, its status and metrics. One request's path
through it is director.py's."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field

import httpx
from fastapi.responses import Response
from prometheus_client import generate_latest

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.admission import no_engine
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.director import Target, Ticket, check_body, check_headers
from kvfleet.gateway.engines.adapters import ServedAdapters
from kvfleet.gateway.engines.client import engine_client
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.engines.scraper import Scraper
from kvfleet.gateway.limits.access import admit_key, authenticate
from kvfleet.gateway.limits.tenant_caps import TenantInFlight
from kvfleet.gateway.limits.tenant_metrics import TenantMetrics
from kvfleet.gateway.limits.tenant_share import InFlightShares
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.models.routes import ModelRoute
from kvfleet.gateway.prefix.events_sse import KVEventFollower
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys, Tokenize
from kvfleet.gateway.proxy import Forwarder
from kvfleet.gateway.queue.fleet import FleetQueue
from kvfleet.gateway.routing.pick import available, free_slots
from kvfleet.gateway.routing.router import Router
from kvfleet.gateway.routing.strategies import PREFIX_STRATEGIES
from kvfleet.gateway.slo_counts import SloCounts

log = logging.getLogger("kvfleet.gateway")


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
    keys: object | None = None  # limits/keys.py's ApiKeyStore when API keys are on
    limiter: object | None = None  # limits/rate_limit.py's RateLimiter when per-key limits are on
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
        self.client = engine_client(c.upstream_connect_timeout_s)  # engines/client.py
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
        if c.data_plane == "python" or c.hands_off:  # else Envoy carries the bytes
            self.forwarder = Forwarder(c, self.client, self.router)
        self.adapters = ServedAdapters(self.pool, c.engine_api_key)
        self.scraper = Scraper(self.pool, c.scrape_interval_s, on_scrape=self._scraped,
                               unreachable_after_s=c.engine_unreachable_after_s,
                               queued=lambda: self.queue.total() > 0)
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

    # ---- one request: the front's calls into the director (director.py) -------------------------------------
    def check_headers(self, request_headers: Mapping[str, str], priority: Priority) -> Ticket:
        """What the request's headers allow, before its body is read (director.check_headers)."""
        return check_headers(self.config, self.keys, request_headers, priority)

    def target(self, ticket: Ticket, path: str, raw: bytes) -> Target:
        """The fleet the body goes to: this one, once the body passes the engines' schema."""
        return Target(self, path, raw, check_body(path, raw))

    def has_room(self) -> bool:
        """Whether a request arriving now would go to an engine at once (nobody waits, an engine has room)."""
        return self.queue.total() == 0 and bool(available(self.pool.snapshots(), self.config.saturation))

    def run_in_background(self, work: Coroutine) -> None:
        """A Redis write started from sync code (the relay's end), awaited at stop."""
        task = asyncio.create_task(work)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def count_call(self, key: object | None) -> None:
        """A call that generates nothing (/v1/models) counted against the key's requests per minute; 429 past it."""
        await admit_key(self.limiter, key, None, self.metrics, self.run_in_background, None, self.tenant_metrics)

    async def models_response(self, request_headers: Mapping[str, str]) -> Response:
        """GET /v1/models: the key checked and counted, then an engine's own list."""
        await self.count_call(authenticate(self.keys, request_headers))
        upstream, url = await self.engine_models()
        return Response(upstream.content, upstream.status_code, media_type="application/json",
                        headers={headers.ENGINE: url})

    async def engine_models(self) -> tuple[httpx.Response, str]:
        """An engine's GET /v1/models answer, and the engine; 503 while none is available, 502 if it fails."""
        url = self.router.choose(PromptKeys([]), must=True)
        if url is None:
            raise no_engine("no engine is available yet")
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
            self.metrics.batch_capacity.labels(e.url).set(e.max_num_seqs or 0)
            self.metrics.slot_seconds.labels(e.url).set(e.slot_seconds or 0.0)
        for state, n in states.items():
            self.metrics.endpoints.labels(state).set(n)


def _discovery(config: GatewayConfig):
    from kvfleet.gateway.engines.discovery import KubernetesDiscovery, StaticDiscovery

    if config.k8s_selector:
        return KubernetesDiscovery(config.k8s_namespace, config.k8s_selector, config.k8s_port_name)
    return StaticDiscovery(config.engines)


def request_id_from(given: str | None) -> str:
    """The client's x-request-id when it is short, ASCII and printable (it goes on to the engine), else a new one."""
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex
