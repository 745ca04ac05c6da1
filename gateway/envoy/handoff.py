"""The Envoy plane's hand-off: an answer the gateway can migrate passes through the gateway's app on loopback.

Envoy cannot splice a stream, and an engine that resets its connection mid-answer ends Envoy's stream to the client
(once an answer has begun, Envoy's router resets the client's side too). So where migration is on
(`--migration-limit` > 0, GatewayConfig.hands_off), the picker admits and routes a request as always, then parks it
here under a random key and tells Envoy to send it to the gateway's own app (the `x-kvfleet-hop` route that
bootstrap.py builds); the app takes it back, and the Python proxy's forwarder (proxy.py) sends it to the engine the
picker chose, relays the answer and continues it on another engine when its engine drops it (migration.py). Envoy
keeps the client's side: its limits, the Lua filter's usage count and the access log that settles the request.
A non-streamed request, and a stream that cannot be continued (several choices, tools, a constrained output), still
go from Envoy straight to their engine (handed_off says why).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet.fleet import headers
from kvfleet.fleet.client_gone import unless_client_leaves
from kvfleet.fleet.errors import APIError

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from kvfleet.gateway.director import Admission
    from kvfleet.gateway.routing.router import Dispatch

HOP_HEADER = "x-kvfleet-hop"  # the parked request's key; set by the picker only (it removes a client's)


@dataclass
class Handoff:
    admission: Admission
    pick: Dispatch
    request_id: str


class Handoffs:
    """Requests the picker routed and Envoy has yet to bring to the app, by key (the picker and the app share this
    process and its event loop)."""

    def __init__(self) -> None:
        self._parked: dict[str, Handoff] = {}

    def park(self, handoff: Handoff) -> str:
        key = secrets.token_hex(16)  # unguessable: the app's port answers whoever reaches it
        self._parked[key] = handoff
        return key

    def take(self, key: str) -> Handoff | None:
        """The request parked under key, once; None for a key never given or already taken."""
        return self._parked.pop(key, None)

    def drop(self, key: str) -> bool:
        """Forgets a request Envoy never brought (its client left first); True if it was still parked."""
        return self._parked.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._parked)


def handed_off(admission: Admission) -> bool:
    """Whether an admitted request goes through the app: admitted as continuable (its fleet hands off, and it is a
    stream its engine sends the token ids in: director.admit). A non-streamed answer stays on Envoy's direct path:
    its engine sends it whole at its end, so an engine that dies before then resets before the answer began, which
    Envoy retries on the picker's fallback (sent again whole); relaying it through the app would double the
    gateway's CPU per request (docs/benchmarks.md) for the one case Envoy cannot retry, an answer an engine aborts
    with a 200."""
    return admission.continuable


async def serve_handoff(handoffs: Handoffs, request: Request, path: str) -> Response:
    """The app's side: the parked request, sent, relayed and migrated by its fleet's forwarder. Its settlement stays
    with Envoy's access log (envoy/feed.py), which counts the answer's usage as the client got it."""
    handoff = handoffs.take(request.headers.get(HOP_HEADER, ""))
    if handoff is None:
        return APIError(400, f"the {HOP_HEADER} header names no request this gateway handed off; send requests "
                             "without it", code="invalid_hop").response()
    admission = dataclasses.replace(handoff.admission, settlement=None)
    try:
        response = await unless_client_leaves(request.receive, admission.gateway.forwarder.forward(
            admission, path, headers.combined(request.headers.raw), handoff.request_id, first=handoff.pick))
    except APIError as err:
        response = err.response()
    response.headers[headers.REQUEST_ID] = handoff.request_id
    return response
