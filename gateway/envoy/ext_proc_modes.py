"""The ext_proc processing modes the picker speaks: our own Envoy's (request body BUFFERED, no response phase) and
the ones a Gateway API Inference Extension gateway (kgateway, Envoy Gateway, Istio, GKE) configures for its
endpoint picker, announced in the first message's protocol_config: request body FULL_DUPLEX_STREAMED, response
headers SEND, response body FULL_DUPLEX_STREAMED or STREAMED, trailers.

FULL_DUPLEX_STREAMED request body, as the Inference Extension's reference EPP answers it: the headers phase is not
answered until the whole body has arrived (the route depends on it); then the headers phase gets the route and the
body goes back as streamed_response chunks. STREAMED (or NONE) cannot route by body: the headers phase would have
to be answered before the body is seen, so such a stream gets a clear 500 naming the gateway's setting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvfleet.fleet.body_limit import too_large_message
from kvfleet.fleet.errors import APIError

log = logging.getLogger("kvfleet.gateway.picker")

BUFFERED, FULL_DUPLEX = ProcessingMode.BUFFERED, ProcessingMode.FULL_DUPLEX_STREAMED
_ROUTABLE = frozenset({BUFFERED, ProcessingMode.BUFFERED_PARTIAL, FULL_DUPLEX})
# Envoy's gateways accept at most 64 KiB per streamed chunk; the reference EPP keeps the same margin below it.
CHUNK_BYTES = 62000
_told: set[int] = set()  # the unusable modes already logged: a misconfigured gateway must not flood the log


@dataclass(frozen=True, slots=True)
class Modes:
    """The body modes in force on one stream."""

    request_body: int = BUFFERED
    response_body: int = ProcessingMode.NONE

    @property
    def duplex(self) -> bool:
        return self.request_body == FULL_DUPLEX


OWN = Modes()  # our own Envoy's (gateway/envoy/bootstrap.py), which sends no protocol_config


@dataclass(frozen=True, slots=True)
class StreamedBody:
    """A FULL_DUPLEX_STREAMED request body as it arrived, and whether trailers ended it (they then wait for an
    answer after the body's)."""

    body: bytes = b""
    trailers: bool = False


def modes_of(first: pb.ProcessingRequest) -> Modes:
    """The modes the gateway announced in the stream's first message; none announced: our own Envoy's."""
    if not first.HasField("protocol_config"):
        return OWN
    config = first.protocol_config
    return Modes(config.request_body_mode, config.response_body_mode)


def refuse_unroutable(modes: Modes) -> None:
    """APIError 500 when the gateway's request body mode does not let the picker see the body before routing."""
    if modes.request_body in _ROUTABLE:
        return
    name = ProcessingMode.BodySendMode.Name(modes.request_body)
    if modes.request_body not in _told:
        _told.add(modes.request_body)
        log.error("the gateway's ext_proc request_body_mode is %s: the picker routes by the body and needs "
                  "FULL_DUPLEX_STREAMED or BUFFERED; every generation request is refused with 500", name)
    raise APIError(500, f"the gateway's ext_proc request_body_mode {name} cannot route by the request body; "
                        "configure FULL_DUPLEX_STREAMED (or BUFFERED)", "server_error",
                   code="unsupported_processing_mode")


async def read_streamed_body(context: grpc.aio.ServicerContext, max_bytes: int) -> StreamedBody:
    """The whole request body from its FULL_DUPLEX_STREAMED chunks. APIError 413 past max_bytes, 499 when the
    stream ends first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await context.read()
        if message is grpc.aio.EOF:
            raise APIError(499, "the client closed the connection", code="client_closed")
        if message.HasField("request_trailers"):
            return StreamedBody(b"".join(chunks), trailers=True)
        body = message.request_body
        size += len(body.body)
        if size > max_bytes:
            raise APIError(413, too_large_message(max_bytes), code="request_too_large")
        chunks.append(body.body)
        if body.end_of_stream:
            return StreamedBody(b"".join(chunks))


def streamed_route(route: pb.ProcessingResponse, body: bytes, trailers: bool) -> list[pb.ProcessingResponse]:
    """A body phase's route (gateway/envoy_messages.route_to) said the FULL_DUPLEX_STREAMED way: the headers phase
    carries the route and the body's length, then the body goes back in chunks, the last one ending the stream
    (or, when the request had trailers, their answer does)."""
    common = pb.CommonResponse()
    common.CopyFrom(route.request_body.response)
    common.ClearField("body_mutation")
    content_length = [h for h in common.header_mutation.set_headers if h.header.key == "content-length"]
    if content_length:
        content_length[0].header.raw_value = str(len(body)).encode()
    else:
        length = common.header_mutation.set_headers.add()
        length.header.key, length.header.raw_value = "content-length", str(len(body)).encode()
        length.append_action = length.OVERWRITE_IF_EXISTS_OR_ADD
    answers = [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                     dynamic_metadata=route.dynamic_metadata)]
    for start in range(0, max(len(body), 1), CHUNK_BYTES):
        end = start + CHUNK_BYTES >= len(body) and not trailers
        answers.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=body[start:start + CHUNK_BYTES], end_of_stream=end))))))
    if trailers:
        answers.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
    return answers


_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())


def answer_after_route(message: pb.ProcessingRequest, modes: Modes) -> pb.ProcessingResponse | None:
    """The answer to a message that comes after the route (the response's phases, trailers): let it pass unchanged,
    so that nothing waits on the picker. A FULL_DUPLEX_STREAMED response body must be sent back chunk by chunk."""
    kind = message.WhichOneof("request")
    if kind == "response_headers":
        return _HEADERS_CONTINUE
    if kind == "response_body":
        if modes.response_body != FULL_DUPLEX:
            return _BODY_CONTINUE
        chunk = message.response_body
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=chunk.body, end_of_stream=chunk.end_of_stream)))))
    if kind == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if kind == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return None  # a late request body chunk has nothing to answer once the body was answered whole
