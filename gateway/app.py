"""`kvfleet gateway`: one OpenAI-compatible front for a fleet of engines.

Per request: authenticate, read the class and queue deadline, then route at once, wait in the fleet queue, or
shed (admission.py); the chosen engine's answer passes through unbuffered (proxy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet.engine.api_errors import APIError, install_error_handlers
from kvfleet.engine.body_limit import BodyLimit
from kvfleet.gateway.admission import Action, admit, retry_after_seconds
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.endpoints import EndpointPool
from kvfleet.gateway.fleet_queue import FleetQueue, Outcome
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix import PrefixAffinity, prompt_text
from kvfleet.gateway.priority import Priority, parse_priority
from kvfleet.gateway.proxy import Forwarder
from kvfleet.gateway.routing import available, free_slots
from kvfleet.gateway.scraper import Scraper

log = logging.getLogger("kvfleet.gateway")

# vLLM's semantics: lower runs first. Sheddable work an engine has accepted is not pushed back there: engines
# order strictly by priority, without the gateway queue's aging, so it could starve behind a steady stream.
ENGINE_PRIORITY = {Priority.CRITICAL: -1, Priority.STANDARD: 0, Priority.SHEDDABLE: 0}


@dataclass
class Gateway:
    """Everything one gateway replica holds; built by `build_app`, started and stopped by its lifespan."""

    config: GatewayConfig
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    pool: EndpointPool = field(init=False)
    prefix: PrefixAffinity = field(default_factory=PrefixAffinity)
    client: httpx.AsyncClient | None = None
    queue: FleetQueue | None = None
    scraper: Scraper | None = None
    forwarder: Forwarder | None = None
    discovery: object | None = None
    keys: object | None = None  # gateway.auth.ApiKeyStore when API keys are on
    limiter: object | None = None  # gateway.rate_limit.RateLimiter when per-key limits are on
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _release_task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.pool = EndpointPool(self.config.eject_after_failures, self.config.eject_seconds)

    # ---- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=c.upstream_connect_timeout_s),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512, keepalive_expiry=30.0))
        self.queue = FleetQueue(c.redis_url, c.fleet, c.gateway_id, c.aging_ms, c.queue_caps,
                                on_backend_change=lambda up: self.metrics.redis_up.set(1 if up else 0))
        self.queue.release_window_ms = max(1, round(c.scrape_interval_s * 1000))
        await self.queue.start()
        self.metrics.redis_up.set(1 if self.queue.using_redis else 0)
        if self.keys is not None and self.limiter is None:
            from kvfleet.gateway.rate_limit import InProcessRateLimiter, RateLimiter

            self.limiter = RateLimiter(self.queue.client, c.fleet) if self.queue.client else InProcessRateLimiter()
        self.forwarder = Forwarder(c, self.client, self.pool, self.prefix, self.metrics)
        self.scraper = Scraper(self.client, self.pool, c.scrape_interval_s, on_scrape=lambda url: self.poke())
        self.discovery = self.discovery or _discovery(c)
        self._tasks.append(asyncio.create_task(self.discovery.run(self.set_endpoints), name="discovery"))
        self._tasks.append(asyncio.create_task(self._release_ticker(), name="release ticker"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.scraper:
            await self.scraper.stop()
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
        if total == 0:
            return
        slots = free_slots(self.pool.snapshots(), self.config.saturation)
        if slots == 0:
            return
        for _, owner in await self.queue.release(min(slots, total)):
            if owner != self.config.gateway_id:  # another replica sends it; count it where it will likely go
                url = self.forwarder.choose([], must=True)
                if url is not None:
                    self.pool.record_expected(url)

    # ---- one request --------------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        request_id = _request_id(request.headers.get("x-request-id"))
        priority = Priority.STANDARD
        try:
            try:
                priority = parse_priority(request.headers.get("x-kvfleet-priority"))
            except ValueError as err:
                raise APIError(400, str(err), param="x-kvfleet-priority") from None
            response = await self._handle(request, path, request_id, priority)
        except APIError as err:
            response = err.response()
        response.headers["x-request-id"] = request_id
        self.metrics.requests.labels(priority.value, str(response.status_code)).inc()
        return response

    async def _handle(self, request: Request, path: str, request_id: str, priority: Priority) -> Response:
        max_queue_ms = self._max_queue_ms(request.headers.get("x-kvfleet-max-queue-ms"))
        key = await self._authenticate(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "the body is not valid JSON; send a JSON object") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        hashes = self.prefix.block_hashes(prompt_text(body)) if self.config.routing == "kvfleet" else []
        if self.config.forward_priority and ENGINE_PRIORITY[priority] and "priority" not in body:
            body["priority"] = ENGINE_PRIORITY[priority]  # the engine admits and preempts by it too
            raw = json.dumps(body).encode()

        has_capacity = bool(available(self.pool.snapshots(), self.config.saturation))
        counts = self.queue.counts()
        verdict = admit(priority, has_capacity, sum(counts.values()), counts[priority],
                        self.config.queue_caps[priority])
        if verdict.action is Action.SHED:
            raise self._shed(priority, verdict.reason, verdict.message)
        released = False
        if verdict.action is Action.QUEUE:
            await self._wait_in_queue(request, priority, max_queue_ms, has_capacity)
            released = True
        return await self.forwarder.forward(path, raw, dict(request.headers), request_id, hashes, released,
                                            on_tokens=self._token_counter(key))

    async def _wait_in_queue(self, request: Request, priority: Priority, max_queue_ms: float,
                             has_capacity: bool) -> None:
        entry = await self.queue.enqueue(priority, max_queue_ms)
        if entry is None:
            raise self._shed(priority, "queue_full", f"the fleet queue for {priority.value} requests is full "
                                                     f"({self.config.queue_caps[priority]} waiting); retry later")
        if has_capacity:
            self.poke()
        started = time.monotonic()
        outcome = await self.queue.wait(entry, request.is_disconnected)
        self.metrics.queue_wait.labels(priority.value).observe(time.monotonic() - started)
        if outcome is Outcome.EXPIRED:
            self.metrics.shed.labels(priority.value, "deadline").inc()
            raise APIError(503, f"the fleet stayed saturated for {max_queue_ms:.0f} ms, the longest this request "
                                "may wait (x-kvfleet-max-queue-ms); retry later", "service_unavailable",
                           code="queue_timeout", headers={"retry-after": str(self._retry_after())})
        if outcome is Outcome.DISCONNECTED:
            self.metrics.shed.labels(priority.value, "disconnected").inc()
            raise APIError(499, "the client closed the connection while queued", code="client_closed")

    def _shed(self, priority: Priority, reason: str, message: str) -> APIError:
        self.metrics.shed.labels(priority.value, reason).inc()
        return APIError(429, message, "rate_limit_exceeded", code=f"shed_{reason}",
                        headers={"retry-after": str(self._retry_after())})

    def _retry_after(self) -> int:
        return retry_after_seconds(self.queue.total(), self.queue.drain_rate_per_s())

    def _max_queue_ms(self, header: str | None) -> float:
        if header is None or header == "":
            return self.config.default_max_queue_ms
        limit = self.config.max_queue_ms_limit
        try:
            value = float(header)
        except ValueError:
            value = -1.0
        if not 0 <= value <= limit:
            raise APIError(400, f"x-kvfleet-max-queue-ms must be a number of milliseconds from 0 to {limit:.0f}, "
                                f"not {header!r}", param="x-kvfleet-max-queue-ms")
        return value

    async def _authenticate(self, request: Request) -> object | None:
        if self.keys is None:
            return None
        key = self.keys.authenticate_headers(request.headers)
        if key is None:
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
        if self.limiter is not None:
            verdict = await self.limiter.admit(key)
            if not verdict.allowed:
                self.metrics.shed.labels("any", f"rate_limit_{verdict.reason}").inc()
                per = "requests" if verdict.reason == "rpm" else "tokens"
                raise APIError(429, f"API key {key.key_id} is over its {per}-per-minute limit; retry in "
                                    f"{verdict.retry_after_s} s", "rate_limit_exceeded", code=f"{verdict.reason}_limit",
                               headers={"retry-after": str(verdict.retry_after_s)})
        return key

    def _token_counter(self, key: object | None) -> Callable[[int], None] | None:
        """Counts an answer's tokens against the key's limit; None (nothing to count) without limits."""
        if key is None or self.limiter is None or getattr(key, "tpm", None) is None:
            return None

        def count(n: int) -> None:
            if n > 0:
                task = asyncio.create_task(self.limiter.record_tokens(key, n))
                self._tasks.append(task)
                task.add_done_callback(self._tasks.remove)
        return count

    # ---- status -------------------------------------------------------------------------------------------
    def ready_body(self) -> dict:
        snaps = self.pool.snapshots()
        body = {"status": "ready", "engines": len(snaps), "healthy": sum(e.healthy for e in snaps),
                "available": len(available(snaps, self.config.saturation)), "queue": self.queue.backend,
                "queued": self.queue.total()}
        if self.queue.redis_error:
            body["redis"] = self.queue.redis_error
        return body

    def render_metrics(self) -> bytes:
        snaps = self.pool.snapshots()
        policy = self.config.saturation
        states = {"available": 0, "saturated": 0, "unhealthy": 0}
        for e in snaps:
            states["unhealthy" if not e.healthy else "saturated" if policy.is_saturated(e) else "available"] += 1
            self.metrics.scrape_age.labels(e.url).set(min(e.metrics_age_s, 1e9))
        for state, n in states.items():
            self.metrics.endpoints.labels(state).set(n)
        return generate_latest(self.metrics.registry)


def _discovery(config: GatewayConfig):
    from kvfleet.gateway.discovery import KubernetesDiscovery, StaticDiscovery

    if config.k8s_selector:
        return KubernetesDiscovery(config.k8s_namespace, config.k8s_selector, config.k8s_port_name)
    return StaticDiscovery(config.engines)


def _request_id(given: str | None) -> str:
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


def build_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="kvfleet gateway", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=gateway.config.max_body_bytes)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse(gateway.ready_body())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        await gateway._authenticate(request)
        url = gateway.forwarder.choose([], must=True)
        if url is None:
            raise APIError(503, "no engine is available yet; retry shortly", "service_unavailable",
                           code="no_engine", headers={"retry-after": "1"})
        try:
            upstream = await gateway.client.get(f"{url}/v1/models", timeout=5.0)
        except httpx.HTTPError as err:
            raise APIError(502, f"engine {url} failed: {type(err).__name__}", "server_error") from err
        return Response(upstream.content, upstream.status_code, media_type="application/json",
                        headers={"x-kvfleet-engine": url})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "/v1/chat/completions")

    return app
