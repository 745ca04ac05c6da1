"""The endpoint picker: the gateway's decision core behind Envoy's external processing (ext_proc) gRPC API, as the
Gateway API Inference Extension's endpoint picker protocol has it.

Per generation request Envoy opens one stream: the request's headers (answered "continue" once the key and the
priority header pass), then its buffered body. The picker runs the same decisions as the Python proxy
(Gateway.admit_request: schema, limits, priority, admission, the fleet queue) and answers with the chosen engine in
`x-gateway-destination-endpoint` (and a rewritten body when the trust rule changed it), or with an immediate
OpenAI error (400, 401, 429, 503 with Retry-After). A queued request is a stream the picker holds; the stream ends
when Envoy has finished the HTTP request, which is when the engine's in-flight count drops. No token passes here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    add_ExternalProcessorServicer_to_server,
)
from google.protobuf.duration_pb2 import Duration

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import DEFAULT_PRIORITY, parse_priority
from kvfleet.gateway.app import Gateway, request_id_from
from kvfleet.gateway.envoy_config import PICKER_MARGIN_S
from kvfleet.gateway.envoy_messages import header_map, immediate, route_to

log = logging.getLogger("kvfleet.gateway.picker")


class EndpointPicker(ExternalProcessorServicer):
    """One Envoy stream per request; the decisions are the gateway's own."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC's name)
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("request_headers"):
            return
        request_headers = header_map(first.request_headers)
        request_id = request_id_from(request_headers.get(headers.REQUEST_ID))
        priority = DEFAULT_PRIORITY
        url: str | None = None
        try:
            try:
                priority = parse_priority(request_headers.get(headers.PRIORITY))
            except ValueError as err:
                raise APIError(400, str(err), param=headers.PRIORITY) from None
            url = await self._decide(context, request_headers, priority, first.request_headers.end_of_stream)
        except APIError as err:
            if err.status != 499:  # a client that left is answered by nobody
                await context.write(immediate(err, request_id))
            self.gateway.metrics.requests.labels(priority.value, str(err.status)).inc()
            return
        self.gateway.metrics.requests.labels(priority.value, "200").inc()
        try:
            while await context.read() is not grpc.aio.EOF:  # Envoy closes the stream when the request is done
                pass
        finally:
            self.gateway.pool.record_done(url, None)

    async def _decide(self, context: grpc.aio.ServicerContext, request_headers: Mapping[str, str],
                      priority, no_body: bool) -> str:
        gateway = self.gateway
        left = asyncio.Event()
        context.add_done_callback(lambda _: left.set())

        async def read_body() -> bytes:
            if no_body:  # Envoy sends no body message for an empty body: the schema refuses it as the proxy does
                return b""
            await context.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
            message = await context.read()
            if message is grpc.aio.EOF:
                raise APIError(499, "the client closed the connection", code="client_closed")
            return message.request_body.body

        async def is_disconnected() -> bool:
            return left.is_set()

        async def on_queue(max_queue_ms: float) -> None:  # Envoy holds the request as long as the queue may
            seconds = max_queue_ms / 1000.0 + PICKER_MARGIN_S
            await context.write(pb.ProcessingResponse(
                override_message_timeout=Duration(seconds=int(seconds), nanos=int(seconds % 1 * 1e9))))

        path = request_headers.get(":path", "").split("?", 1)[0]
        admitted = await gateway.admit_request(path, request_headers, read_body, priority, is_disconnected, on_queue)
        if admitted.settlement is not None:
            admitted.settlement.abandoned()  # Envoy relays the answer: its token count is not seen here (yet)
        url = gateway.forwarder.choose(admitted.hashes, must=admitted.released)
        if url is None:
            raise APIError(503, "no engine is available; retry later", "service_unavailable", code="no_engine",
                           headers={headers.RETRY_AFTER: "1"})
        gateway.pool.record_dispatch(url)
        gateway.metrics.routed.labels(url).inc()
        if admitted.hashes:
            gateway.prefix.record(admitted.hashes, url)
        await context.write(route_to(url, admitted.body if admitted.changed else None,
                                     gateway.config.engine_api_key))
        return url


async def start_picker(gateway: Gateway, port: int) -> grpc.aio.Server:
    """The picker's gRPC server on loopback (Envoy is its only client)."""
    server = grpc.aio.server()
    add_ExternalProcessorServicer_to_server(EndpointPicker(gateway), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server
