"""Forwarding to an engine: pick, send, retry once elsewhere before the first byte, relay streams unbuffered."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from kvfleet.engine.api_errors import APIError
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.endpoints import EndpointPool
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix import PrefixAffinity
from kvfleet.gateway.routing import pick

log = logging.getLogger(__name__)

# Only what the engine needs goes upstream: no client credentials, cookies or hop-by-hop headers.
FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "tracestate")
RETURNED_HEADERS = ("content-type", "retry-after", "x-request-id")
BUSY_STATUSES = (429, 503)  # the engine is full or draining: try another, but it is not broken


@dataclass
class Upstream:
    url: str
    response: httpx.Response
    sent_at: float


def upstream_headers(headers: dict[str, str], request_id: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k in FORWARDED_HEADERS}
    out["x-request-id"] = request_id
    return out


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Forwarder:
    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient, pool: EndpointPool,
                 prefix: PrefixAffinity, metrics: GatewayMetrics, rng: random.Random | None = None):
        self.config, self.client, self.pool, self.prefix, self.metrics = config, client, pool, prefix, metrics
        self.rng = rng or random.Random()
        self._counter = 0

    def choose(self, hashes: list[bytes], exclude: frozenset[str] = frozenset(), must: bool = False) -> str | None:
        self._counter += 1
        chosen = pick(self.config.routing, self.pool.snapshots(), self.prefix.matches(hashes), self.rng,
                      self._counter, self.config.weights, self.config.saturation, exclude, must)
        return chosen.url if chosen else None

    async def forward(self, path: str, raw_body: bytes, headers: dict[str, str], request_id: str,
                      hashes: list[bytes], released: bool, on_tokens: Callable[[int], None] | None) -> Response:
        """Sends to the chosen engine; a connection error, 5xx, or a busy answer is retried once elsewhere."""
        tried: set[str] = set()
        last_busy: tuple[str, httpx.Response] | None = None
        last_error = "no engine is available"
        for attempt in range(2):
            url = self.choose(hashes, frozenset(tried), must=released or attempt > 0)
            if url is None:
                break
            tried.add(url)
            upstream = await self._send(url, path, raw_body, headers, request_id)
            if isinstance(upstream, str):
                last_error = upstream
                self.metrics.retries.labels("connect_error" if attempt == 0 else "gave_up").inc()
                continue
            status = upstream.response.status_code
            if status >= 500 or status in BUSY_STATUSES:
                await upstream.response.aread()
                await upstream.response.aclose()
                self._done(url, ok=status in BUSY_STATUSES)
                last_busy, last_error = (url, upstream.response), f"engine {url} answered {status}"
                self.metrics.retries.labels(f"status_{status}" if attempt == 0 else "gave_up").inc()
                continue
            self.prefix.record(hashes, url)
            return await self._relay(upstream, on_tokens)
        if last_busy is not None:
            return _passthrough(last_busy[1], last_busy[1].content, last_busy[0])
        raise APIError(502 if tried else 503, f"{last_error}; retry later", "service_unavailable",
                       code="no_engine", headers={"retry-after": "1"})

    async def _send(self, url: str, path: str, raw_body: bytes, headers: dict[str, str],
                    request_id: str) -> Upstream | str:
        self.pool.record_dispatch(url)
        self.metrics.routed.labels(url).inc()
        sent_at = time.monotonic()
        request = self.client.build_request("POST", url + path, content=raw_body,
                                            headers=upstream_headers(headers, request_id))
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as err:
            self._done(url, ok=False)
            return f"engine {url} failed: {type(err).__name__} {err}".strip()
        self.metrics.upstream_latency.labels(url).observe(time.monotonic() - sent_at)
        return Upstream(url, response, sent_at)

    def _done(self, url: str, ok: bool) -> None:
        if self.pool.record_done(url, ok):
            log.warning("ejecting engine %s for %.0f s after repeated failures", url, self.pool.eject_seconds)
            self.metrics.ejections.labels(url).inc()

    async def _relay(self, upstream: Upstream, on_tokens: Callable[[int], None] | None) -> Response:
        response = upstream.response
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as err:
                self._done(upstream.url, ok=False)
                raise APIError(502, f"engine {upstream.url} failed while answering: {type(err).__name__}",
                               "server_error", code="upstream_error") from err
            finally:
                await response.aclose()
            self._done(upstream.url, ok=True)
            if on_tokens is not None:
                on_tokens(_usage_tokens(content))
            return _passthrough(response, content, upstream.url)
        return StreamingResponse(self._stream(upstream, on_tokens), status_code=response.status_code,
                                 headers=_returned(response, upstream.url), media_type="text/event-stream")

    async def _stream(self, upstream: Upstream, on_tokens: Callable[[int], None] | None) -> AsyncIterator[bytes]:
        ok, events = True, 0
        try:
            async for chunk in upstream.response.aiter_raw():
                if on_tokens is not None:
                    events += chunk.count(b"data: {")
                yield chunk
        except httpx.HTTPError as err:
            ok = False
            log.warning("engine %s failed mid-stream: %s", upstream.url, type(err).__name__)
            yield sse_error_event(f"the engine serving this request failed mid-stream ({type(err).__name__}); "
                                  "the output above is incomplete")
        finally:
            await upstream.response.aclose()
            self._done(upstream.url, ok)
            if on_tokens is not None:
                on_tokens(events)


def _returned(response: httpx.Response, url: str) -> dict[str, str]:
    out = {k: v for k, v in response.headers.items() if k in RETURNED_HEADERS and k != "content-type"}
    out["x-kvfleet-engine"] = url
    return out


def _passthrough(response: httpx.Response, content: bytes, url: str) -> Response:
    return Response(content, status_code=response.status_code, headers=_returned(response, url),
                    media_type=response.headers.get("content-type"))


def _usage_tokens(content: bytes) -> int:
    try:
        usage = json.loads(content).get("usage") or {}
        return int(usage.get("total_tokens", 0))
    except (ValueError, AttributeError, TypeError):
        return 0
