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
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # a chunked body: the app's error handler answers 413
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, send) -> None:
        body = json.dumps(APIError(413, too_large_message(self.max_bytes), code="request_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
