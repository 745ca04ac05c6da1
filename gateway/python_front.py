"""The Python proxy's front (`--data-plane python`, where Envoy cannot run): one request admitted by the decision
core (core.py), then sent, retried and relayed by the Forwarder (proxy.py); its answer counted in its fleet's
metrics."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvfleet.fleet import headers
from kvfleet.fleet.client_gone import unless_client_leaves
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import DEFAULT_PRIORITY, Priority, parse_priority
from kvfleet.gateway.core import Admitted, Gateway, request_id_from


async def handle_request(front, request: Request, path: str) -> Response:
    """One request through the Python proxy: `front` (a Gateway, or a ModelFront of several) admits it to a fleet,
    whose forwarder sends it; the answer is counted in that fleet's metrics (the front's before one is chosen)."""
    request_id = request_id_from(request.headers.get(headers.REQUEST_ID))
    priority = DEFAULT_PRIORITY
    fleet = [front]
    try:
        try:
            priority = parse_priority(request.headers.get(headers.PRIORITY))
        except ValueError as err:
            raise APIError(400, str(err), param=headers.PRIORITY) from None
        gateway, admitted = await front.admit(path, request.headers, request.body, priority,
                                              request.is_disconnected, on_fleet=lambda g: fleet.append(g))
        response = await send_admitted(gateway, request, path, request_id, priority, admitted)
    except APIError as err:
        response = err.response()
    response.headers[headers.REQUEST_ID] = request_id
    fleet[-1].metrics.requests.labels(priority.value, str(response.status_code)).inc()
    return response



async def send_admitted(gateway: Gateway, request: Request, path: str, request_id: str, priority: Priority,
                        admitted: Admitted) -> Response:
    """The Python proxy's half after admission: forward to an engine, settle the token reservation."""
    settlement = admitted.settlement
    try:
        response = await unless_client_leaves(request.receive, gateway.forwarder.forward(
            path, admitted.body, request.headers.raw, request_id, admitted.hashes, on_tokens=settlement,
            critical=priority is Priority.CRITICAL))
        if admitted.degraded is not None:
            response.headers[headers.DEGRADED] = admitted.degraded
    except BaseException as err:
        if settlement is not None and isinstance(err, APIError) and err.status == 499:
            settlement.abandoned()  # the engine worked for a client that left: its count is unknown
        elif settlement is not None:
            settlement.refund()  # failed before an answer: nothing was generated
        raise
    if settlement is not None and not isinstance(response, StreamingResponse):
        settlement.refund()  # an answer the relay did not count (a busy engine's refusal); no-op once settled
    return response
