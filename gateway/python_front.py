"""The Python proxy's front (`--data-plane python`, where Envoy cannot run): it translates one HTTP request into the
director's calls (director.py: the headers' checks, the fleet, the admission, the wait, the engine) and the answer
back; the Forwarder (proxy.py) sends, retries and relays. The answer is counted in its fleet's metrics."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvfleet.fleet import headers
from kvfleet.fleet.client_gone import unless_client_leaves
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import DEFAULT_PRIORITY
from kvfleet.gateway.core import request_id_from
from kvfleet.gateway.director import Admission, admit, request_class


async def handle_request(front, request: Request, path: str) -> Response:
    """One request through the Python proxy: `front` (a Gateway, or a ModelFront of several) checks its headers and
    finds its fleet, which admits it and whose forwarder sends it; the answer is counted in that fleet's metrics
    (the front's before one is known)."""
    fields = headers.combined(request.headers.raw)
    request_id = request_id_from(fields.get(headers.REQUEST_ID))
    priority, counted_by = DEFAULT_PRIORITY, front
    try:
        priority = request_class(fields)
        ticket = front.check_headers(fields, priority)
        target = front.target(ticket, path, await request.body())
        counted_by = target.gateway
        admission = await admit(ticket, target, continuable=target.gateway.config.migration_limit > 0)
        await unless_client_leaves(request.receive, admission.wait())
        response = await send_admitted(admission, request, fields, path, request_id)
    except APIError as err:
        response = err.response()
    response.headers[headers.REQUEST_ID] = request_id
    counted_by.metrics.requests.labels(priority.value, str(response.status_code)).inc()
    return response


async def send_admitted(admission: Admission, request: Request, fields: Mapping[str, str], path: str,
                        request_id: str) -> Response:
    """The Python proxy's half after admission: forward to an engine, settle the token reservation."""
    settlement = admission.settlement
    try:
        response = await unless_client_leaves(request.receive, admission.gateway.forwarder.forward(
            admission, path, fields, request_id))
        if admission.degraded is not None:
            response.headers[headers.DEGRADED] = admission.degraded
    except BaseException as err:
        if settlement is not None and isinstance(err, APIError) and err.status == 499:
            settlement.abandoned()  # the engine worked for a client that left: its count is unknown
        else:
            admission.refund()  # failed before an answer: nothing was generated
        raise
    if settlement is not None and not isinstance(response, StreamingResponse):
        settlement.refund()  # an answer the relay did not count (a busy engine's refusal); no-op once settled
    return response
