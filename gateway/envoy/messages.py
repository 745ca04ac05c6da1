"""The picker's messages to Envoy (ext_proc): reading request headers and the subset hint, routing to engines,
answering at once; in the Gateway API Inference Extension's endpoint picker protocol (its proposal 004)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.gateway.envoy.bootstrap import DESTINATION_HEADER
from kvfleet.gateway.envoy.eds import envoy_address
from kvfleet.gateway.envoy.handoff import HOP_HEADER

# The protocol's names: where the picker's list goes (and the header of the same name), where the proxy's subset is.
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"

# Client credentials for the gateway never reach an engine; the engines' own token replaces them.
_CLIENT_CREDENTIALS = (headers.AUTHORIZATION, headers.API_KEY)


def header_map(message: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's request headers as every check reads them (headers.combined; values arrive in raw_value)."""
    return headers.combined((h.key, h.raw_value or h.value) for h in message.headers.headers)


def _set(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode("latin-1")),
                             append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def immediate(err: APIError, request_id: str) -> pb.ProcessingResponse:
    """An OpenAI error answered by Envoy at once, without an engine."""
    set_headers = [_set("content-type", "application/json"), _set(headers.REQUEST_ID, request_id)]
    set_headers += [_set(k, v) for k, v in err.headers.items()]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=err.status), headers=pb.HeaderMutation(set_headers=set_headers),
        body=json.dumps(err.body()).encode()))


def continue_with_request_id(request_id: str) -> pb.ProcessingResponse:
    """The headers phase's "continue", with the request's id replaced."""
    mutation = pb.HeaderMutation(set_headers=[_set(headers.REQUEST_ID, request_id)])
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=mutation)))


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints (`ip:port`, or `ip` for any port) the proxy allows for this request, from the first message's
    metadata; None when it sent no hint. A list of strings or one comma-separated string, as proxies send either."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    items = [v.string_value for v in value.list_value.values] if value.HasField("list_value") else [
        value.string_value]
    return frozenset(entry.strip() for item in items for entry in item.split(",") if entry.strip())


def route_to(urls: Sequence[str], body: bytes | None, engine_api_key: str | None,
             request_id: str | None = None) -> pb.ProcessingResponse:
    """The body phase's answer: go to these engines in order (the chosen one, then the fallback Envoy retries on),
    with the engines' token, the gateway's request id (the client's when short and printable, as the Python proxy
    keeps it; Envoy answers with the id the request carries) and maybe a new body. The list goes in the destination
    header, which Envoy's override-host policy reads, and, the same, in `envoy.lb` metadata, as the protocol asks."""
    destinations = ",".join(envoy_address(url) for url in urls)
    set_headers = [_set(DESTINATION_HEADER, destinations)]
    if request_id is not None:
        set_headers.append(_set(headers.REQUEST_ID, request_id))
    remove = [*_CLIENT_CREDENTIALS, HOP_HEADER]  # a client's own hop header would send it to the gateway's app
    if engine_api_key:
        set_headers.append(_set(headers.AUTHORIZATION, f"Bearer {engine_api_key}"))
        remove.remove(headers.AUTHORIZATION)
    # the route is chosen again from the new header: with a fallback, it is the route that retries
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers, remove_headers=remove),
                               clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
        common.header_mutation.set_headers.append(_set("content-length", str(len(body))))
    metadata = Struct()  # set field by field: Struct.update from dicts costs more than twice as much
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destinations
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def route_to_hop(key: str, request_id: str | None = None) -> pb.ProcessingResponse:
    """The body phase's answer for a request handed to the gateway's app (envoy/handoff.py): Envoy's hop route, by the
    parked request's key. The app sends the admitted body (and the engines' token) itself: Envoy's copy of the body
    is left as it is, and the client's credentials go no further."""
    set_headers = [_set(HOP_HEADER, key)]
    if request_id is not None:
        set_headers.append(_set(headers.REQUEST_ID, request_id))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers,
                                                                 remove_headers=list(_CLIENT_CREDENTIALS)),
                               clear_route_cache=True)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
