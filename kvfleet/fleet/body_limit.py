"""ASGI middleware: a request body over the limit gets 413 in OpenAI's error shape, before the app reads it all.

A declared Content-Length over the limit is refused here; a chunked body is cut off while it is read.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from kvfleet.fleet.errors import APIError

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def too_large_message(max_bytes: int) -> str:
    return f"the request body is over {max_bytes} bytes; send a smaller prompt"


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 by_path: dict[str, tuple[int, str]] | None = None) -> None:
        """by_path: path -> (its own limit, what to do instead), e.g. the Batch API's uploads."""
        self.app = app
        self.max_bytes = max_bytes
        self.by_path = by_path or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        own = self.by_path.get(scope.get("path", ""))
        max_bytes = self.max_bytes if own is None else own[0]
        message = (too_large_message(max_bytes) if own is None
                   else f"the request body is over {max_bytes} bytes; {own[1]}")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._reject(send, message)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message_ = await receive()
            if message_["type"] == "http.request":
                received += len(message_.get("body", b""))
                if received > max_bytes:  # a chunked body: the app's error handler answers 413
                    raise HTTPException(413, message)
            return message_

        await self.app(scope, limited_receive, send)

    async def _reject(self, send, message: str) -> None:
        body = json.dumps(APIError(413, message, code="request_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
