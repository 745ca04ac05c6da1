"""Cheap limits every kvfleet HTTP server applies before any handler runs: header count and size, slow headers,
slow bodies, and connections that never send anything.

uvicorn's httptools parser accumulates a header block without bound (ten 32 MiB blocks held 455 MiB in the gateway)
and never times out a request head that arrives byte by byte; its keep-alive timer starts only after a first
response. The protocol below bounds both while the bytes arrive, before the ASGI app (authentication included) sees
the request; `BodyDeadline` bounds the body in the app, where the answer can be a normal OpenAI error.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus

import httptools
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet.fleet.errors import APIError
from kvfleet.fleet.headers import RETRY_AFTER


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection bounds; the defaults leave every real client far inside them."""

    max_header_count: int = 100
    max_header_bytes: int = 64 * 1024  # the request line and all headers together
    header_timeout_s: float = 15.0  # from a request's first byte to its last header
    body_timeout_s: float = 60.0  # from the app's first read of the body to its last byte
    max_connections: int = 4096  # open connections per server; a request on one beyond it gets 503

    def __post_init__(self) -> None:
        if self.max_header_count < 8 or self.max_header_bytes < 1024:
            raise ValueError("--max-header-count must be >= 8 and --max-header-bytes >= 1024")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("--header-timeout and --body-timeout must be positive (seconds)")
        if self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")

    # What a client is told when it meets a limit, one wording for every data plane (the Python front and Envoy):
    # (status, message, code).
    def too_many_headers(self) -> tuple[int, str, str]:
        return 431, f"the request has more than {self.max_header_count} headers; send fewer", "too_many_headers"

    def headers_too_large(self) -> tuple[int, str, str]:
        return (431, f"the request headers are over {self.max_header_bytes} bytes; send fewer or shorter headers",
                "request_headers_too_large")

    def head_too_slow(self) -> tuple[int, str, str]:
        return 408, f"the request headers did not arrive within {self.header_timeout_s:g} s", "request_timeout"

    def body_too_slow(self) -> str:  # the 408's message
        return body_too_slow_message(self.body_timeout_s)

    def too_many_connections(self) -> tuple[int, str, str]:
        return (503, f"this server has {self.max_connections} connections open, its limit; retry shortly",
                "too_many_connections")


def body_too_slow_message(seconds: float) -> str:
    return f"the request body did not arrive within {seconds:g} s; send it faster or make it smaller"


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape that closes the connection."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps(APIError(status, message, kind, code=code).body()).encode()
    retry = f"{RETRY_AFTER}: 1\r\n" if status == 503 else ""
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n{retry}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


LINGER_S = 2.0  # how long a refused connection's further bytes are read and dropped before it is closed


class _HeadRefused(Exception):
    """Raised inside a parser callback to stop parsing; httptools re-raises it as the context of its own error."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of `limits` on each request head and on idle new connections."""

    limits: HttpLimits = HttpLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request head, or waiting for the next one
        self._head_bytes = 0
        self._head_count = 0
        self._heads_done = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only after a response: a connection that never sends stayed open forever.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # refused: what else arrives is dropped unread (and unkept)
        self._unset_keepalive_if_required()
        if self._in_head and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_too_slow)
        was_in_head, heads_done = self._in_head, self._heads_done
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:
                self.send_400_response("Invalid HTTP request received.")
            return
        if was_in_head and self._in_head and heads_done == self._heads_done:
            # All of this chunk belongs to a head that is still incomplete: the parser buffers it.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(*self.limits.headers_too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_count += 1
        if self._head_count > self.limits.max_header_count:
            self._refusal = self.limits.too_many_headers()
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if len(self.connections) > self.limits.max_connections:  # uvicorn's own cap answers in plain text
            self._refusal = self.limits.too_many_connections()
            raise _HeadRefused
        self._in_head, self._head_bytes = False, 0
        self._heads_done += 1
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # an answer is still being written: no room for ours
            return
        self._refuse(*self.limits.head_too_slow())

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._cancel_head_timer()
        self._in_head = False
        if self.transport.is_closing():
            return
        self.transport.write(error_bytes(status, message, code))
        # A lingering close, as nginx does: closing with unread bytes from a client still sending would reset the
        # connection, and a reset can destroy the answer before the client reads it.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._lingering = True
        self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to these limits."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class BodyDeadline:
    """ASGI middleware: a request body must arrive within `seconds` of the app's first read of it, or 408.

    Only the body is bounded: once its last part arrived, reads (which then wait for a disconnect) are left alone.
    """

    def __init__(self, app, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        body_done = expired = False

        async def bounded_receive():
            nonlocal deadline, body_done, expired
            if body_done:
                return await receive()
            deadline = deadline or loop.time() + self.seconds
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                expired = True
                raise HTTPException(408, body_too_slow_message(self.seconds)) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def closing_send(message) -> None:
            if expired and message["type"] == "http.response.start":  # the rest of the body must not be awaited
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, bounded_receive, closing_send)
