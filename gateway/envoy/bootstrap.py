"""Envoy's bootstrap for the gateway's Envoy data plane, built from GatewayConfig (pure).

Envoy carries the bytes; the gateway's endpoint picker decides. Generation requests pass Envoy's ext_proc filter:
the picker gets their headers, then their buffered body, and answers with the chosen engine and a fallback in
`x-gateway-destination-endpoint` (the Gateway API Inference Extension's header), which the engines' cluster (EDS
from a file, override-host load balancing) tries in order, retrying once on an engine's failure, or with an
immediate answer (401, 400, 429, 503), or hands the request to the gateway's app, which relays its answer from the
engine and migrates it when the engine drops it (envoy/handoff.py). Responses and streams never pass the picker.
Everything else (/health, /ready, /metrics, /v1/models) goes to the gateway's own HTTP app on loopback.
"""

from __future__ import annotations

from pathlib import Path

from kvfleet.fleet import headers
from kvfleet.fleet.engine_settings import POOL_IDLE_S
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.envoy.handoff import HOP_HEADER
from kvfleet.gateway.envoy.lua import USAGE_NAMESPACE, attempt_access_log, lua_filter, usage_access_log
from kvfleet.gateway.envoy.replies import local_reply_config

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Inference Extension's endpoint picker protocol
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PICKER_CLUSTER, ENGINES_CLUSTER, APP_CLUSTER = "kvfleet_picker", "kvfleet_engines", "kvfleet_gateway_app"
# Envoy waits this long for the picker's answer to one message; a request about to wait in the fleet queue
# extends it to its own queue deadline (override_message_timeout), up to the longest a request may wait. A picker
# starved of CPU by engines beside it (two vLLM engines on a 2-core machine under load) once took over 2 s to
# answer, and its client got 503 picker_unavailable for a picker that was only slow; a picker that is down refuses
# Envoy's connection at once, so the wait only bounds a hung one.
PICKER_MESSAGE_TIMEOUT_S = 10.0
PICKER_MARGIN_S = 10.0


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, port: int, http2: bool = False) -> dict:
    cluster: dict = {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        # the app carries every handed-off answer (envoy/handoff.py): as many at once as the engines' cluster
        "circuit_breakers": {"thresholds": [{"max_connections": 4096, "max_pending_requests": 4096,
                                             "max_requests": 4096}]},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address("127.0.0.1", port)}}]}]},
    }
    cluster["typed_extension_protocol_options"] = _http_options(http2)  # HTTP/2 for the picker's gRPC
    return cluster


def _http_options(http2: bool = False) -> dict:
    """HTTP/2, or HTTP/1.1 whose idle connections Envoy lets go before the server behind it closes them
    (engine_settings.KEEP_ALIVE_S: kvfleet's servers and the vLLM engines kvfleet starts), so that no request is sent
    on a connection being closed."""
    protocol = {"http2_protocol_options": {}} if http2 else {"http_protocol_options": {}}
    idle = {} if http2 else {"common_http_protocol_options": {"idle_timeout": _seconds(POOL_IDLE_S)}}
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": protocol, **idle}}


def _typed(name: str, type_name: str, **config: object) -> dict:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_name}", **config}}


def _engines_cluster(config: GatewayConfig, engines_file: Path | None) -> dict:
    """The engines, fed by EDS from `engines_file` (gateway/envoy/eds.py writes it; None: no engines, for
    Envoy run alone). The override-host policy sends each try to the next address of the picker's list."""
    override_host = _typed(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[{"header": DESTINATION_HEADER}],
        # only when the list is used up or names no member (the file lags the pool by a moment): any engine
        fallback_policy={"policies": [{"typed_extension_config": _typed(
            "envoy.load_balancing_policies.least_request",
            "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest")}]})
    cluster: dict = {
        "name": ENGINES_CLUSTER, "connect_timeout": _seconds(config.upstream_connect_timeout_s),
        "load_balancing_policy": {"policies": [{"typed_extension_config": override_host}]},
        "typed_extension_protocol_options": _http_options(),
        # the gateway's connection cap toward engines, as the Python proxy's client had; retries are not capped
        # apart from it (Envoy's default allows 3 at a time: a failing engine under load would go unretried)
        "circuit_breakers": {"thresholds": [{"max_connections": 4096, "max_pending_requests": 4096,
                                             "max_requests": 4096, "max_retries": 4096}]},
    }
    if engines_file is None:
        return {**cluster, "type": "STATIC", "load_assignment": {"cluster_name": ENGINES_CLUSTER, "endpoints": []}}
    return {**cluster, "type": "EDS", "eds_cluster_config": {"service_name": ENGINES_CLUSTER, "eds_config": {
        "resource_api_version": "V3",
        "path_config_source": {"path": str(engines_file), "watched_directory": {"path": str(engines_file.parent)}}}}}


# Envoy's retry, as the Python proxy's (engines/failure_class.py): once, on another engine, before the first byte of
# the answer reaches the client, for connection failures and resets, an engine's marked fault, a 502/504 from
# something between, and a busy 429/503. A 4xx or an unmarked 5xx the request caused is returned as it is.
# (A 4xx marked as the engine's fault is retried too: one header matcher cannot also ask for a 5xx. It still
# never counts toward ejection: failure_class.classify_attempt calls it the request's.)
RETRIED_STATUSES = (429, 502, 503, 504)


def _retry_policy() -> dict:
    return {
        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes,retriable-headers",
        "num_retries": 1,
        "retriable_status_codes": list(RETRIED_STATUSES),
        "retriable_headers": [{"name": headers.FAULT,
                               "string_match": {"exact": headers.ENGINE_FAULT, "ignore_case": True}}],
        "retry_host_predicate": [_typed("envoy.retry_host_predicates.previous_hosts",
                                        "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate")],
        "host_selection_retry_max_attempts": 3,
        "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.005s"},  # another engine: no need to wait
    }


def _longest_wait_s(config: GatewayConfig) -> float:
    """The longest a request may wait in the fleet queue, with the picker's margin."""
    return config.max_queue_ms_limit / 1000.0 + PICKER_MARGIN_S


def stream_silence_s(config: GatewayConfig) -> float:
    """How long a request's stream may see no byte either way before Envoy ends it. Envoy has one idle timer for
    a stream's whole life, where the Python proxy has a first-byte timeout (a non-streamed answer arrives whole,
    minutes later), an idle gap between chunks, and the queue wait before either: the largest of them, so that
    none cuts a healthy request. An engine that stops answering is found sooner by its silent /metrics
    (--engine-unreachable-after), and the picker ends the requests it holds on it (gateway/envoy/ext_proc.py)."""
    return max(config.upstream_first_byte_timeout_s, config.upstream_idle_timeout_s, _longest_wait_s(config))


def _ext_proc_filter(config: GatewayConfig) -> dict:
    longest = _longest_wait_s(config)
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, "timeout": _seconds(longest)},
        "failure_mode_allow": False,  # no routing without the picker: its keys, limits and queue are the point
        "status_on_error": {"code": 503},
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        "message_timeout": _seconds(PICKER_MESSAGE_TIMEOUT_S),
        "max_message_timeout": _seconds(longest),
        "mutation_rules": {"allow_all_routing": True},
        # the picker's ticket and usage flags for the Lua filter and the access log (envoy/feed.py), and the
        # Inference Extension's envoy.lb destinations; Envoy forwards a subset hint to the picker when one is set
        "metadata_options": {"receiving_namespaces": {"untyped": [USAGE_NAMESPACE, "envoy.lb"]},
                             "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}},
    }}


def _routes(config: GatewayConfig) -> list[dict]:
    """Generation requests go to the engines: with a retry when the picker named a fallback engine (its list has a
    comma; the picker clears the route cache so the route is chosen again), without one when it named only one,
    as the Python proxy retries only elsewhere."""
    to_engines = {"cluster": ENGINES_CLUSTER, "timeout": "0s",  # no total limit: long streams are normal
                  "idle_timeout": _seconds(stream_silence_s(config))}
    # the engine's URL, the EDS endpoint's hostname (envoy/eds.py); none on the picker's own answers
    name_engine = [{"header": {"key": headers.ENGINE, "value": "%UPSTREAM_HOST_NAME%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}]
    with_fallback = [{"name": DESTINATION_HEADER, "string_match": {"contains": ","}}]
    # a request the picker handed to the gateway's app, which relays and migrates its answer (envoy/handoff.py);
    # the app names the engine itself, and retries elsewhere itself
    handed = [{"match": {"path": path, "headers": [{"name": HOP_HEADER, "present_match": True}]},
               "route": {**to_engines, "cluster": APP_CLUSTER}}
              for path in GENERATION_PATHS] if config.hands_off else []
    generation = handed + [{"match": {"path": path, "headers": with_fallback},
                   "route": {**to_engines, "retry_policy": _retry_policy()}, "response_headers_to_add": name_engine}
                  for path in GENERATION_PATHS]
    generation += [{"match": {"path": path}, "route": to_engines, "response_headers_to_add": name_engine}
                   for path in GENERATION_PATHS]
    own = {"match": {"prefix": "/"}, "route": {"cluster": APP_CLUSTER, "timeout": "30s"},
           "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
               "disabled": True}}}
    return [*generation, own]


def build_bootstrap(config: GatewayConfig, host: str, port: int, picker_port: int, app_port: int,
                    admin_port: int, engines_file: Path | None = None) -> dict:
    """Envoy's whole configuration: one listener on host:port in front of the picker, the engines (from the EDS
    file `engines_file`; None: none) and the app."""
    limits = config.http_limits
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "kvfleet", "codec_type": "AUTO",
        "route_config": {"name": "kvfleet", "virtual_hosts": [{"name": "all", "domains": ["*"],
                                                              "routes": _routes(config)}]},
        "http_filters": [_ext_proc_filter(config), lua_filter(),
                         {"name": "envoy.filters.http.router", "typed_config": {
                             "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                             "upstream_log": [attempt_access_log(PICKER_CLUSTER)]}}],  # outcomes per attempt
        # the cheap limits on client input, in Envoy's terms (kvfleet.fleet.http_limits holds their values)
        "max_request_headers_kb": max(1, limits.max_header_bytes // 1024),
        "common_http_protocol_options": {"max_headers_count": limits.max_header_count,
                                         "idle_timeout": "75s", "headers_with_underscores_action": "ALLOW"},
        "request_headers_timeout": _seconds(limits.header_timeout_s),
        "stream_idle_timeout": _seconds(stream_silence_s(config)),
        # the request id is the gateway's rule (the client's when short and printable, else a new one: the picker
        # sets it), not a UUID Envoy would make before the picker sees the request
        "preserve_external_request_id": True, "generate_request_id": False,
        "always_set_request_id_in_response": True,
        "access_log": [usage_access_log(PICKER_CLUSTER)],  # each routed request's status and usage to the picker
        "local_reply_config": local_reply_config(config),  # Envoy's own answers as OpenAI errors
    }
    listener = {
        "name": "kvfleet", "address": _address(host, port),
        # a body larger than this is refused (413) before the picker sees it
        "per_connection_buffer_limit_bytes": config.max_body_bytes,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }
    return {
        "node": {"id": "kvfleet-gateway", "cluster": "kvfleet"},  # EDS (even from a file) requires a node
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [listener],
            "clusters": [_static_cluster(PICKER_CLUSTER, picker_port, http2=True),
                         _engines_cluster(config, engines_file), _static_cluster(APP_CLUSTER, app_port)],
        },
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                                      "downstream_connections.v3.DownstreamConnectionsConfig",
                             "max_active_downstream_connections": limits.max_connections}}]},
    }
