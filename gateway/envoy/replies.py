"""Envoy's own answers (limits met, the picker or an engine not answering) in OpenAI's error shape (pure).

Envoy answers some requests itself, before or instead of the picker and the engines: a head over the header limits
(431), one too slow to arrive (408), a body over the limit (413), the picker not answering, no engine reachable.
Its default bodies are plain text; these local-reply mappers give them the same JSON error body, code and wording
as the Python front (kvfleet.fleet.http_limits, kvfleet.fleet.body_limit), so a client's error handling does not
depend on the data plane. The picker's own immediate answers are already OpenAI errors and match no mapper.
Malformed HTTP is refused by Envoy's codec before any mapper runs: a plain-text 400 and a closed connection, as the
Python front answers it.
"""

from __future__ import annotations

from kvfleet.fleet.body_limit import too_large_message
from kvfleet.fleet.headers import RETRY_AFTER
from kvfleet.gateway.config import GatewayConfig

# Envoy's response flags that mean no engine gave an answer (connection failure, no healthy host, retries used up,
# overflow, upstream timeout or reset...): https://www.envoyproxy.io/docs/envoy/latest/configuration/observability/access_log/usage
ENGINE_FAILURE_FLAGS = ("UF", "UH", "URX", "UO", "UC", "UT", "UMSDR", "UPE", "NC")


def _details(expression: str) -> dict:
    """A filter on Envoy's response code details (why Envoy answered), as a CEL expression."""
    return {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": expression}}}


def _status(code: int) -> dict:
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": {
        "default_value": code, "runtime_key": f"kvfleet.local_reply.{code}"}}}}


def _mapper(match: dict, status: int | None, message: str, code: str, type_: str = "invalid_request_error") -> dict:
    mapper: dict = {"filter": match, "body_format_override": {
        "json_format": {"error": {"message": message, "type": type_, "param": None, "code": code}},
        "content_type": "application/json"}}
    if status is not None:
        mapper["status_code"] = status
    if status == 503 or type_ == "service_unavailable":
        mapper["headers_to_add"] = [{"header": {"key": RETRY_AFTER, "value": "1"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    return mapper


def local_reply_config(config: GatewayConfig) -> dict:
    """The HTTP connection manager's local_reply_config: first matching mapper wins."""
    limits = config.http_limits
    count, size, slow = limits.too_many_headers(), limits.headers_too_large(), limits.head_too_slow()
    return {"mappers": [
        _mapper(_details("response.code_details.endsWith('too_many_headers')"), *count),
        _mapper(_details("response.code_details.endsWith('headers_too_large')"), *size),
        _mapper(_status(431), *size),
        _mapper(_details("response.code_details == 'request_header_timeout'"), *slow),
        _mapper(_status(413), 413, too_large_message(config.max_body_bytes), "request_too_large"),
        # the picker is down or broke its stream: Envoy answers (status_on_error) instead of routing blind
        _mapper(_details("response.code_details.startsWith('ext_proc_error')"), 503,
                "the gateway's endpoint picker is not answering; retry shortly", "picker_unavailable",
                "service_unavailable"),
        _mapper({"response_flag_filter": {"flags": list(ENGINE_FAILURE_FLAGS)}}, None,
                "no engine answered this request (%RESPONSE_CODE_DETAILS%); retry later", "engine_unavailable",
                "service_unavailable"),
    ]}
