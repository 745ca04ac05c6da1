"""The picker's messages to Envoy (ext_proc): reading request headers, routing to an engine, answering at once."""

from __future__ import annotations

import json

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.gateway.envoy_config import DESTINATION_HEADER

# Client credentials for the gateway never reach an engine; the engines' own token replaces them.
_CLIENT_CREDENTIALS = (headers.AUTHORIZATION, headers.API_KEY)


def header_map(message: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's request headers as a lower-case dict (values arrive in raw_value)."""
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value)
            for h in message.headers.headers}


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


def route_to(url: str, body: bytes | None, engine_api_key: str | None) -> pb.ProcessingResponse:
    """The body phase's answer: go to this engine (host:port), with the engines' token and maybe a new body."""
    set_headers = [_set(DESTINATION_HEADER, url.split("://", 1)[-1].rstrip("/"))]
    remove = list(_CLIENT_CREDENTIALS)
    if engine_api_key:
        set_headers.append(_set(headers.AUTHORIZATION, f"Bearer {engine_api_key}"))
        remove.remove(headers.AUTHORIZATION)
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers, remove_headers=remove))
    if body is not None:
        common.body_mutation.body = body
        common.header_mutation.set_headers.append(_set("content-length", str(len(body))))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
