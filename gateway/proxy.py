"""Forwarding to an engine: pick, send, retry once elsewhere before the first byte, relay streams unbuffered.

Only the engine's faults (engines/failure_class.py) are retried and counted toward ejection; every wait on an engine is
bounded (first byte, then each gap between chunks), so an engine that stops answering cannot hang a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from fastapi.responses import Response, StreamingResponse

from kvfleet.fleet.errors import APIError
from kvfleet.fleet.headers import AUTHORIZATION, FORWARDED, REQUEST_ID, RETRY_AFTER
from kvfleet.fleet.headers import ENGINE as ENGINE_HEADER
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.engines.failure_class import AnswerClass, classify
from kvfleet.gateway.limits.usage import StreamUsageMeter, answer_usage
from kvfleet.gateway.migration import ABORTED, Events, Relayed
from kvfleet.gateway.routing.router import Dispatch, Router

if TYPE_CHECKING:
    from kvfleet.gateway.director import Admission

log = logging.getLogger(__name__)

RETURNED_HEADERS = ("content-type", RETRY_AFTER, REQUEST_ID)
DONE_EVENT = b"data: [DONE]"
CONTINUATION_PATH = "/v1/completions"  # a continuation is a completion of the answer's token ids
# why an engine's answer is not the model's whole answer (the cause label of kvfleet_gateway_migrations_total)
ENDED = {"timeout": "stopped sending", "error": "broke off", "broken": "ended the stream without [DONE]",
         "aborted": "aborted the answer"}


@dataclass
class Upstream:
    url: str
    response: httpx.Response
    sent_at: float


def upstream_headers(headers: Mapping[str, str], request_id: str, engine_api_key: str | None = None) -> dict[str, str]:
    """What the engine is sent of the client's headers (kvfleet.fleet.headers.combined: the view the checks read)."""
    out = {name: value for name, value in headers.items() if name in FORWARDED}
    out[REQUEST_ID] = request_id
    if engine_api_key:
        out[AUTHORIZATION] = f"Bearer {engine_api_key}"  # never the client's own credentials
    return out


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Forwarder:
    """The Python proxy's half after admission: sends to the engine the router picks, retries, relays."""

    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient, router: Router):
        self.config, self.client, self.router = config, client, router
        self.pool, self.metrics = router.pool, router.metrics

    async def forward(self, admission: Admission, path: str,
                      headers: Mapping[str, str], request_id: str,
                      first: Dispatch | None = None) -> Response:
        """Sends to the engine the router picks (`first`: the one the Envoy plane's picker already picked and
        recorded, whose fallback is the retry's engine, as Envoy's would be); an engine fault or a busy answer is
        retried once elsewhere, an answer the request caused (4xx, unmarked 5xx) is returned as it is."""
        tried: set[str] = set()
        last_busy: tuple[str, httpx.Response, bytes] | None = None
        last_error = "no engine is available"
        for attempt in range(2):
            # the request was admitted because the fleet had room (or released from the queue, or this is a retry);
            # requests admitted together can fill it before their picks, and then the least-loaded healthy engine
            # queues the request itself rather than the client getting 503 `no_engine`
            pick = first if attempt == 0 and first is not None else self._next(admission, tried, first)
            if pick is None:
                break
            tried.add(pick.url)
            upstream = await self._send(pick, path, admission.body, headers, request_id)
            if isinstance(upstream, str):
                last_error = upstream
                self.metrics.retries.labels("connect_error" if attempt == 0 else "gave_up").inc()
                continue
            status = upstream.response.status_code
            verdict = classify(status, upstream.response.headers)
            if verdict in (AnswerClass.BUSY, AnswerClass.FAULT):
                content = await self._read_quietly(pick.url, upstream.response)
                self._done(pick.url, ok=None if verdict is AnswerClass.BUSY else False)
                if content is not None:
                    last_busy = (pick.url, upstream.response, content)
                last_error = f"engine {pick.url} answered {status}"
                self.metrics.retries.labels(f"status_{status}" if attempt == 0 else "gave_up").inc()
                continue
            ok = True if verdict is AnswerClass.OK else None
            if _is_stream(upstream.response):
                return self._relay_stream(upstream, admission, tried, headers, request_id, ok)
            content, cause = await self._read_answer(upstream)
            if cause is not None and self.config.migration_limit == 0:  # migration off: as the engine ended it
                if cause != "aborted":
                    raise APIError(502, f"engine {pick.url} {ENDED[cause]} while answering; retry", "server_error",
                                   code="upstream_error")
                cause = None
            if cause is not None:  # not yet sent to the client: sent again whole, elsewhere
                if cause == "aborted":
                    self._done(pick.url, ok=False)
                last_error = f"engine {pick.url} {ENDED[cause]} before the answer was whole"
                self.metrics.migrations.labels(cause, "resent" if attempt == 0 else "failed").inc()
                continue
            self._done(pick.url, ok=ok)
            if admission.settlement is not None:
                admission.settlement(answer_usage(upstream.response.status_code, content, time.monotonic()))
            return _passthrough(upstream.response, content, pick.url)
        if last_busy is not None:
            return _passthrough(last_busy[1], last_busy[2], last_busy[0])
        raise admission.no_engine(last_error, 502 if tried else 503)

    def _next(self, admission: Admission, tried: set[str], first: Dispatch | None) -> Dispatch | None:
        critical = admission.priority is Priority.CRITICAL
        fallback = next((url for url in first.fallbacks if url not in tried), None) if first is not None else None
        if fallback is not None and fallback in self.pool.endpoints:
            return self.router.dispatch_to(admission.hashes, fallback, critical)
        return self.router.dispatch(admission.hashes, frozenset(tried), critical)

    async def _send(self, pick: Dispatch, path: str, raw_body: bytes,
                    headers: Mapping[str, str], request_id: str) -> Upstream | str:
        """The engine's answer once its headers arrive (a kvfleet engine sends them with the first output), or why
        none came. A critical request counts at its engine (critical_pending) until then, whatever happens."""
        url, sent_at = pick.url, time.monotonic()
        request = self.client.build_request("POST", url + path, content=raw_body,
                                            headers=upstream_headers(headers, request_id, self.config.engine_api_key))
        try:
            async with self._bounded(url, self.config.upstream_first_byte_timeout_s):
                response = await self.client.send(request, stream=True)
        except TimeoutError:
            self._done(url, ok=False)
            return (f"engine {url} did not answer within {self.config.upstream_first_byte_timeout_s:g} s, or "
                    "stopped answering its /metrics")
        except httpx.HTTPError as err:
            self._done(url, ok=False)
            return f"engine {url} failed: {type(err).__name__} {err}".strip()
        finally:  # headers, a failure, or the client gone (cancelled): it no longer waits to start there
            pick.started()
        self.metrics.upstream_latency.labels(url).observe(time.monotonic() - sent_at)
        return Upstream(url, response, sent_at)

    def _done(self, url: str, ok: bool | None) -> None:
        """ok None: the answer says nothing about the engine's health (busy, or the request's own fault)."""
        if self.pool.record_done(url, ok):
            log.warning("ejecting engine %s for %.0f s after repeated failures", url, self.pool.eject_seconds)
            self.metrics.ejections.labels(url).inc()

    @contextlib.asynccontextmanager
    async def _bounded(self, url: str, seconds: float) -> AsyncIterator[None]:
        """A wait on an engine: TimeoutError after `seconds`, or at once when the engine turns unreachable."""
        async with asyncio.timeout(seconds) as wait:
            self.pool.watch(url, wait)
            try:
                yield
            finally:
                self.pool.unwatch(url, wait)

    async def _read_quietly(self, url: str, response: httpx.Response) -> bytes | None:
        """The body of an answer that will not be relayed as it is; None if the engine fails to send it in time."""
        try:
            async with self._bounded(url, self.config.upstream_idle_timeout_s):
                return await response.aread()
        except (httpx.HTTPError, TimeoutError):
            return None
        finally:
            await response.aclose()

    async def _read_answer(self, upstream: Upstream) -> tuple[bytes, str | None]:
        """A non-streamed answer's body, and why it is not the model's whole answer (None: it is): its engine broke
        off while sending it, stopped sending, or aborted it (vLLM answers 200 with finish_reason `abort` when its
        pod stops under it)."""
        response = upstream.response
        try:
            async with self._bounded(upstream.url, self.config.upstream_idle_timeout_s):
                content = await response.aread()
        except TimeoutError:
            self._done(upstream.url, ok=False)
            return b"", "timeout"
        except httpx.HTTPError:
            self._done(upstream.url, ok=False)
            return b"", "error"
        finally:
            await response.aclose()
        if response.status_code == 200 and ABORTED.search(content):
            return content, "aborted"  # its engine counted by the caller: failed if resent, as it was if relayed
        return content, None

    def _relay_stream(self, upstream: Upstream, admission: Admission, tried: set[str],
                      headers: Mapping[str, str], request_id: str,
                      ok: bool | None) -> Response:
        """The engine's stream, relayed as it comes; where its engine ends it early, continued on another engine
        (migration.py) when the engine was asked for its token ids."""
        on_tokens = admission.settlement
        # Counts the answer's tokens from the engine's usage chunk, hidden again if only the gateway asked for it.
        meter = StreamUsageMeter(on_tokens.hide_stream_usage) if on_tokens is not None else None
        relayed = (Relayed(admission.body, admission.hide_token_ids, self.config.migration_limit)
                   if admission.continuable and self.config.migration_limit > 0 else None)
        current = [upstream]
        ended = False

        async def end(ok: bool | None) -> None:
            """Once: the engine's connection closed, its answer counted, the request settled with what was relayed."""
            nonlocal ended
            if ended:
                return
            ended = True
            await current[0].response.aclose()
            self._done(current[0].url, ok)
            if on_tokens is not None:
                on_tokens(meter.usage)
        response = upstream.response
        engines = _Engines(self, admission, tried, headers, request_id)
        return RelayedStream(self._stream(current, meter, end, relayed, engines), lambda: end(None),
                             status_code=response.status_code, headers=_returned(response, upstream.url),
                             media_type="text/event-stream")

    async def _stream(self, current: list[Upstream], meter: StreamUsageMeter | None,
                      end: Callable[[bool | None], Awaitable[None]], relayed: Relayed | None,
                      engines: _Engines) -> AsyncIterator[bytes]:
        ok, idle_s = True, self.config.upstream_idle_timeout_s
        try:
            while True:
                upstream, tail, cause = current[0], b"", None
                events = Events()
                chunks = upstream.response.aiter_raw()
                try:
                    while True:
                        try:
                            async with self._bounded(upstream.url, idle_s):
                                chunk = await anext(chunks)
                        except StopAsyncIteration:
                            break
                        tail = (tail + chunk)[-64:]
                        if relayed is not None:  # event by event: what the client gets, what is kept to continue
                            chunk = b"".join(e for e in map(relayed.take, events.feed(chunk)) if e)
                        if meter is not None:
                            chunk = meter.feed(chunk)
                        if chunk:
                            yield chunk
                    if relayed is not None:
                        if (rest := events.finish()) and (passed := relayed.take(rest)):  # no blank line at its end
                            yield meter.feed(passed) if meter is not None else passed
                        cause = None if relayed.whole() else "aborted" if relayed.aborted else "broken"
                    elif DONE_EVENT not in tail:
                        cause = "broken"
                except TimeoutError:
                    cause = "timeout"
                except httpx.HTTPError as err:
                    cause = "error"
                    log.warning("engine %s failed mid-stream: %s", upstream.url, type(err).__name__)
                if cause is None:
                    if relayed is not None:
                        yield DONE_EVENT + b"\n\n"
                    if meter is not None and (rest := meter.finish()):
                        yield rest
                    return
                log.warning("engine %s ended a stream early (%s)", upstream.url, cause)
                follow = relayed.next_request() if relayed is not None else None
                nxt = await engines.send(follow) if follow is not None else None
                if nxt is None:
                    ok = False
                    if relayed is not None:
                        self.metrics.migrations.labels(cause, "failed").inc()
                    if meter is not None and (rest := meter.finish()):
                        yield rest
                    yield _incomplete(cause, idle_s)
                    return
                self.metrics.migrations.labels(cause, "continued").inc()
                await upstream.response.aclose()
                self._done(upstream.url, ok=False)
                current[0] = nxt
        finally:
            await end(ok)


class _Engines:
    """Where a stream goes on when its engine drops it: the next engine the router picks among those not tried."""

    def __init__(self, forwarder: Forwarder, admission: Admission, tried: set[str],
                 headers: Mapping[str, str], request_id: str) -> None:
        self.forwarder, self.admission, self.tried = forwarder, admission, tried
        self.headers, self.request_id = headers, request_id

    async def send(self, body: dict) -> Upstream | None:
        """The continuation's stream from an engine not tried yet (one try), or None."""
        f = self.forwarder
        pick = f.router.dispatch(self.admission.hashes, frozenset(self.tried),
                                 self.admission.priority is Priority.CRITICAL)
        if pick is None:
            return None
        self.tried.add(pick.url)
        upstream = await f._send(pick, CONTINUATION_PATH, json.dumps(body).encode(), self.headers, self.request_id)
        if isinstance(upstream, str) or upstream.response.status_code != 200 or not _is_stream(upstream.response):
            if not isinstance(upstream, str):
                await upstream.response.aclose()
                f._done(pick.url, ok=None)
            return None
        return upstream


def _is_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _incomplete(cause: str, idle_s: float) -> bytes:
    """The error event that ends a stream whose answer could not be made whole: never a bare end that reads like
    success."""
    if cause == "timeout":
        return sse_error_event(f"the engine serving this request sent nothing for {idle_s:g} s, or stopped "
                               "answering its /metrics; the output above is incomplete", "upstream_timeout")
    if cause == "error":
        return sse_error_event("the engine serving this request failed mid-stream; the output above is incomplete")
    return sse_error_event("the engine ended this stream before it completed; the output above is incomplete",
                           "stream_truncated")


class RelayedStream(StreamingResponse):
    """A relayed stream whose end runs however the response ends: a client that leaves before the headers go out
    never starts the stream, and an async generator that never ran has no `finally` to run, which would leave the
    engine's connection open, its in-flight count up and the request's settlement (its tokens, its tenant's in-flight
    slot) never made."""

    def __init__(self, content: AsyncIterator[bytes], end: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._end = end

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._end()


def _returned(response: httpx.Response, url: str) -> dict[str, str]:
    out = {k: v for k, v in response.headers.items() if k in RETURNED_HEADERS and k != "content-type"}
    out[ENGINE_HEADER] = url
    return out


def _passthrough(response: httpx.Response, content: bytes, url: str) -> Response:
    return Response(content, status_code=response.status_code, headers=_returned(response, url),
                    media_type=response.headers.get("content-type"))

