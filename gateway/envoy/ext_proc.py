"""The endpoint picker: the gateway's front behind Envoy's external processing (ext_proc) gRPC API, as the Gateway
API Inference Extension's endpoint picker protocol has it.

Per generation request Envoy opens one stream: the request's headers (answered "continue" once the key and the
priority header pass), then its buffered body. The picker translates them into the director's calls, the same as
the Python front's (director.py: the headers' checks, the fleet, the admission and its wait, the engine and its
fallback), and answers with the chosen engine in
`x-gateway-destination-endpoint` (and a rewritten body when the trust rule changed it), or with an immediate
OpenAI error (400, 401, 429, 503 with Retry-After). A queued request is a stream the picker holds; the stream ends
when Envoy has finished the HTTP request, which is when the engine's in-flight count drops. No token passes here,
unless an Inference Extension gateway chose to stream the response through its picker (gateway/envoy/ext_proc_modes.py:
the modes other gateways configure, such as FULL_DUPLEX_STREAMED).
"""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorServicer
from google.protobuf.duration_pb2 import Duration

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import DEFAULT_PRIORITY
from kvfleet.gateway.core import Gateway, request_id_from
from kvfleet.gateway.director import Admission, admit, request_class
from kvfleet.gateway.envoy.bootstrap import PICKER_MARGIN_S
from kvfleet.gateway.envoy.eds import FALLBACKS, outside_subset
from kvfleet.gateway.envoy.ext_proc_modes import (
    Modes,
    StreamedBody,
    answer_after_route,
    modes_of,
    read_streamed_body,
    refuse_unroutable,
    streamed_route,
)
from kvfleet.gateway.envoy.feed import EnvoyFeed
from kvfleet.gateway.envoy.handoff import Handoff, Handoffs, handed_off
from kvfleet.gateway.envoy.messages import (
    continue_with_request_id,
    header_map,
    immediate,
    route_to,
    route_to_hop,
    subset_hint,
)
from kvfleet.gateway.routing.router import Dispatch

log = logging.getLogger("kvfleet.gateway.picker")
_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())  # the headers phase's answer, built once


class EndpointPicker(ExternalProcessorServicer):
    """One Envoy stream per request; the decisions are the gateway's own."""

    def __init__(self, gateway: Gateway, feed: EnvoyFeed | None = None, handoffs: Handoffs | None = None) -> None:
        self.gateway = gateway
        self.feed = feed  # settles, counts and judges each routed request from Envoy's access log entry
        # where requests handed to the gateway's app wait for Envoy to bring them (envoy/handoff.py); None: an Envoy
        # that routes every request to its engine (one kvfleet did not configure)
        self.handoffs = handoffs

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC's name)
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("request_headers"):
            return
        request_headers = header_map(first.request_headers)
        request_id = request_id_from(request_headers.get(headers.REQUEST_ID))
        priority = DEFAULT_PRIORITY
        modes = modes_of(first)
        counted_by = self.gateway  # the fleet whose metrics count the request, once known
        try:
            refuse_unroutable(modes)
            priority = request_class(request_headers)
            ticket = self.gateway.check_headers(request_headers, priority)
            given = request_headers.get(headers.REQUEST_ID)
            replaced = given is not None and given != request_id  # the client's, not fit to keep (request_id_from)
            raw, streamed = await self._read_body(context, first.request_headers.end_of_stream, modes,
                                                  request_id if replaced else None)
            target = self.gateway.target(ticket, request_headers.get(":path", "").split("?", 1)[0], raw)
            counted_by = target.gateway
            # an answer the app relays can be migrated: a stream asks its engine for the token ids that takes
            can_hand_off = self.handoffs is not None and target.gateway.config.hands_off and not modes.duplex
            admission = await admit(ticket, target, stream_usage=self.feed is not None, continuable=can_hand_off)
            if admission.queued:  # Envoy holds the request as long as its queue deadline allows
                seconds = ticket.max_queue_ms / 1000.0 + PICKER_MARGIN_S
                await context.write(pb.ProcessingResponse(
                    override_message_timeout=Duration(seconds=int(seconds), nanos=int(seconds % 1 * 1e9))))
            await admission.wait()  # gRPC cancels this handler when Envoy resets the stream: its client left
            exclude = outside_subset(target.gateway.router.pool.urls(), subset_hint(first))
            hop = handed_off(admission)
            pick = admission.dispatch(exclude, FALLBACKS)  # the fallback: Envoy's retry, or the app's
            key = self.handoffs.park(Handoff(admission, pick, request_id)) if hop else None
            try:
                await self._route(context, admission, pick, modes, streamed, request_id, key)
            except BaseException:
                self._unpark(key, admission, pick)
                raise
        except APIError as err:
            # counted before the answer goes: Envoy may end the stream once it has the answer, which cancels this
            # handler at the write (a refusal counted after it went uncounted now and then on a busy machine)
            metrics = counted_by.metrics
            metrics.labelled(metrics.requests, priority.value, str(err.status)).inc()
            if err.status != 499:  # a client that left is answered by nobody
                await context.write(immediate(err, request_id))
            return
        gateway, url = admission.gateway, pick.url
        if self.feed is None:  # else counted with the answer's real status from Envoy's entry
            gateway.metrics.labelled(gateway.metrics.requests, priority.value, "200").inc()
        if key is not None:  # the app's forwarder counts it at its engines from here, and ends it on a silent one
            try:
                while await context.read() is not grpc.aio.EOF:
                    pass
            finally:
                self._unpark(key, admission, pick)
            return
        # Envoy closes the stream when the request is done; our own Envoy sends nothing more before that. An engine
        # that stops answering even its /metrics (a blackhole: EndpointPool.mark_unreachable) ends the wait, and
        # the picker ends the request: Envoy answers 503 if the engine had not answered yet, else resets the stream.
        silent = asyncio.timeout(None)
        gateway.pool.watch(url, silent)
        try:
            async with silent:
                while (message := await context.read()) is not grpc.aio.EOF:
                    if message.HasField("response_headers"):
                        pick.started()
                    answer = answer_after_route(message, modes)
                    if answer is not None:
                        await context.write(answer)
        except TimeoutError:
            await context.write(immediate(engine_went_silent(url), request_id))
        finally:
            gateway.pool.unwatch(url, silent)
            gateway.pool.record_done(url, None)
            pick.started()

    async def _read_body(self, context: grpc.aio.ServicerContext, no_body: bool, modes: Modes,
                         new_request_id: str | None = None) -> tuple[bytes, StreamedBody]:
        """The request's body from Envoy: buffered whole after the headers phase's "continue" (bounded in time as the
        Python front bounds it), or streamed in duplex mode; an empty one when Envoy said there is none. The
        "continue" sets the gateway's own request id where the client's was not fit to keep (Envoy answers with the
        id the request carries, refusals included)."""
        streamed = StreamedBody()
        if no_body:  # Envoy sends no body message for an empty body: the schema refuses it as the proxy does
            return b"", streamed
        limits = self.gateway.config.http_limits
        if modes.duplex:  # the headers phase waits for its answer until the route is known
            streamed = await read_streamed_body(context, self.gateway.config.max_body_bytes)
            return streamed.body, streamed
        await context.write(_CONTINUE if new_request_id is None else continue_with_request_id(new_request_id))
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                message = await context.read()
        except TimeoutError:
            raise APIError(408, limits.body_too_slow()) from None
        if message is grpc.aio.EOF:
            raise APIError(499, "the client closed the connection", code="client_closed")
        return message.request_body.body, streamed

    def _unpark(self, key: str | None, admission: Admission, pick: Dispatch) -> None:
        """A handed-off request Envoy never brought to the app (its client left, the route failed) is forgotten and
        leaves its engine's count; once the app took it, its forwarder does that."""
        if key is not None and self.handoffs.drop(key):
            admission.gateway.pool.record_done(pick.url, None)
        pick.started()

    async def _route(self, context: grpc.aio.ServicerContext, admission: Admission, pick: Dispatch, modes: Modes,
                     streamed: StreamedBody, request_id: str | None, key: str | None = None) -> None:
        """Tell Envoy where the request goes (and, in duplex mode, its body): its engines, or the gateway's app by
        the key it is parked under."""
        gateway = admission.gateway
        if key is not None:
            message = route_to_hop(key, request_id)
        else:
            message = route_to([pick.url, *pick.fallbacks], admission.body if admission.changed else None,
                               gateway.config.engine_api_key, request_id)
        if self.feed is not None:  # the ticket Envoy's access log entry brings back with the answer's usage
            ticket, metadata = self.feed.expect(admission.priority.value, admission.settlement, admission.degraded,
                                                gateway.metrics)
            message.dynamic_metadata.MergeFrom(metadata)  # beside the envoy.lb namespace route_to may set
            context.add_done_callback(lambda _: self.feed.closed(ticket))
        elif admission.settlement is not None:
            admission.settlement.abandoned()  # no access log comes back (a foreign Envoy): keep the reservation
        if modes.duplex:
            body = admission.body if admission.changed else streamed.body
            for answer in streamed_route(message, body, streamed.trailers):
                await context.write(answer)
        else:
            await context.write(message)


def engine_went_silent(url: str) -> APIError:
    return APIError(503, f"the engine {url} stopped answering; retry", "service_unavailable",
                    code="engine_unavailable", headers={headers.RETRY_AFTER: "1"})


def freeze_startup_heap() -> None:
    """Moves the ~95,000 objects of the imports and the app out of the collector's reach: a full collection over
    them stalls the event loop, and so every stream the picker holds, for 70-115 ms (the first comes soon after
    start, the next whenever the objects requests leave behind, such as the prefix index, grow by a quarter); with
    them frozen a full collection scans only what the requests made."""
    gc.collect()
    gc.freeze()


def picker_server(gateway: Gateway) -> grpc.aio.Server:
    """A gRPC server whose messages fit a whole request body: the body phase carries up to the gateway's body limit
    each way (gRPC's default 4 MiB would fail a 6 MiB prompt's stream, and Envoy would answer 503, not the 400 or
    the route the picker means)."""
    size = gateway.config.max_body_bytes + 1024 * 1024  # the body, its headers and metadata
    freeze_startup_heap()
    return grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                    ("grpc.max_send_message_length", size)])
