"""ASGI middleware: with a shared token set, every /v1/* route, /tokenize, /detokenize and the KV-event stream
(they carry prompts or their token ids), and /sleep and /wake_up (they change the engine's state) need
`Authorization: Bearer <token>`.

/health, /ready and /metrics stay open (probes and Prometheus; a NetworkPolicy guards them). The token is compared in
constant time; a missing or wrong one gets a 401 in OpenAI's error shape.
"""

from __future__ import annotations

import hmac
import json

from kvfleet.fleet.engine_settings import ENGINE_API_KEY_ENV
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.headers import AUTHORIZATION
from kvfleet.fleet.kv_events import KV_EVENTS_PATH

_AUTHORIZATION = AUTHORIZATION.encode()
PROTECTED_PREFIXES = ("/v1/", KV_EVENTS_PATH, "/tokenize", "/detokenize",  # everything that carries prompts
                      "/sleep", "/wake_up")  # and what changes the engine's state (sleep mode)


def is_authorized(authorization: bytes | None, token: bytes) -> bool:
    """Whether an Authorization header value carries the token (scheme case-insensitive, as RFC 7235 says)."""
    if authorization is None:
        return False
    scheme, _, credentials = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token)


class EngineAPIKey:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.token = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(PROTECTED_PREFIXES):
            headers = [value for name, value in scope.get("headers") or [] if name == _AUTHORIZATION]
            if len(headers) != 1 or not is_authorized(headers[0], self.token):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send) -> None:
    error = APIError(401, "this engine needs `Authorization: Bearer <token>` with the fleet's engine API key "
                          f"({ENGINE_API_KEY_ENV}); send the key the gateway was given", code="invalid_api_key")
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
