"""The gateway's HTTP client to its engines: httpx's API (Request, Response, HTTPError) over aiohttp's connections.

The proxy relays an engine's answer chunk by chunk. httpx's own transport (httpcore on anyio) opened an anyio cancel
scope for every read: on a streamed chat through the gateway, reading cost about as much CPU as everything else the
relay does per chunk (py-spy). aiohttp reads with its C parser and no per-read scope. Measured beside stand-in
engines (docs/gateway.md, "The relay's CPU"): the gateway's Python CPU per streamed chat of 64 tokens 27.6 -> 17.1
ms on the default data plane, 24.9 -> 16.8 ms on the Python plane; of 16 tokens 8.3 -> 7.0 ms. This module is the
one place that knows aiohttp; its errors reach the gateway as the httpx errors httpcore raised for the same failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx
from aiohttp.http_exceptions import HttpProcessingError

KEEPALIVE_S = 4.0  # idle connections let go before vLLM's (uvicorn's) 5 s keep-alive ends them under a request
MAX_CONNECTIONS = 4096

# aiohttp's error -> the httpx error httpcore raises for the same failure, most specific first
_ERRORS: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ClientConnectorError, httpx.ConnectError),  # refused, unreachable, no such host
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),  # closed before or while answering
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),  # a body cut short or malformed
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),  # a status line or headers no HTTP/1.1 server sends
    (HttpProcessingError, httpx.RemoteProtocolError),
    (aiohttp.ClientOSError, httpx.ReadError),  # reset while sending or reading
    (ConnectionError, httpx.ReadError),
    (aiohttp.ClientError, httpx.TransportError),
)


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    try:
        yield
    except tuple(cls for cls, _ in _ERRORS) as err:
        mapped = next(to for cls, to in _ERRORS if isinstance(err, cls))
        raise mapped(f"{type(err).__name__}: {err}".rstrip(": "), request=request) from err


class _Body(httpx.AsyncByteStream):
    """An answer's body as aiohttp reads it: each chunk as it arrives. Closed before its end (the client left, a
    timeout), its connection is closed, so the engine sees the request go and stops generating."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Plain HTTP/1.1 to engines on the cluster's network; no cookies, no redirects, bodies passed through as they
    are (httpx decodes what the gateway reads whole, as before)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:  # in the running loop, at the first request
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        body = await request.aread()
        with _as_httpx(request):
            response = await self._open().request(
                request.method, str(request.url), headers=request.headers.multi_items(), data=body or None,
                allow_redirects=False, compress=None, skip_auto_headers=("Content-Type",),
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout.get("pool"),
                                              sock_connect=timeout.get("connect"), sock_read=timeout.get("read")))
        extensions = {"http_version": b"HTTP/1.1"}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode()
        return httpx.Response(response.status, headers=response.raw_headers, stream=_Body(response, request),
                              request=request, extensions=extensions)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def engine_client(connect_timeout_s: float) -> httpx.AsyncClient:
    """The client the proxy and the gateway's own reads of engines share: no read timeout of its own (the proxy
    bounds each wait itself, gateway/proxy.py), `connect_timeout_s` to connect."""
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout_s), transport=AiohttpTransport())
