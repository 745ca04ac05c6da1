"""Envoy's bootstrap for the gateway's Envoy data plane, built from GatewayConfig (pure).

Envoy carries the bytes; the gateway's endpoint picker decides. Generation requests pass Envoy's ext_proc filter:
the picker gets their headers, then their buffered body, and answers with the chosen engine in
`x-gateway-destination-endpoint` (the Gateway API Inference Extension's header), which an ORIGINAL_DST cluster
connects to, or with an immediate answer (401, 400, 429, 503). Responses and streams never pass the picker.
Everything else (/health, /ready, /metrics, /v1/models) goes to the gateway's own HTTP app on loopback.
"""

from __future__ import annotations

from kvfleet.fleet import headers
from kvfleet.gateway.config import GatewayConfig

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Inference Extension's endpoint picker protocol
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PICKER_CLUSTER, ENGINES_CLUSTER, APP_CLUSTER = "kvfleet_picker", "kvfleet_engines", "kvfleet_gateway_app"
# Envoy waits this long for the picker's answer to one message; a request about to wait in the fleet queue
# extends it to its own queue deadline (override_message_timeout), up to the longest a request may wait.
PICKER_MESSAGE_TIMEOUT_S = 2.0
PICKER_MARGIN_S = 10.0


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, port: int, http2: bool = False) -> dict:
    cluster: dict = {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address("127.0.0.1", port)}}]}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _engines_cluster(config: GatewayConfig) -> dict:
    return {
        "name": ENGINES_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _seconds(config.upstream_connect_timeout_s),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "cleanup_interval": "30s",
        # the gateway's connection cap toward engines, as the Python proxy's client had
        "circuit_breakers": {"thresholds": [{"max_connections": 4096, "max_pending_requests": 4096,
                                             "max_requests": 4096}]},
    }


def _ext_proc_filter(config: GatewayConfig) -> dict:
    longest = config.max_queue_ms_limit / 1000.0 + PICKER_MARGIN_S
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
    }}


def _routes(config: GatewayConfig) -> list[dict]:
    to_engines = {"cluster": ENGINES_CLUSTER, "timeout": "0s",  # no total limit: long streams are normal
                  "idle_timeout": _seconds(config.upstream_idle_timeout_s)}
    generation = [{"match": {"path": path}, "route": to_engines,
                   "response_headers_to_add": [{"header": {"key": headers.ENGINE, "value": "http://%UPSTREAM_HOST%"},
                                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}
                  for path in GENERATION_PATHS]
    own = {"match": {"prefix": "/"}, "route": {"cluster": APP_CLUSTER, "timeout": "30s"},
           "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
               "disabled": True}}}
    return [*generation, own]


def build_bootstrap(config: GatewayConfig, host: str, port: int, picker_port: int, app_port: int,
                    admin_port: int) -> dict:
    """Envoy's whole configuration: one listener on host:port in front of the picker, the engines and the app."""
    limits = config.http_limits
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "kvfleet", "codec_type": "AUTO",
        "route_config": {"name": "kvfleet", "virtual_hosts": [{"name": "all", "domains": ["*"],
                                                              "routes": _routes(config)}]},
        "http_filters": [_ext_proc_filter(config),
                         {"name": "envoy.filters.http.router", "typed_config": {
                             "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        # the cheap limits on client input, in Envoy's terms (kvfleet.fleet.http_limits holds their values)
        "max_request_headers_kb": max(1, limits.max_header_bytes // 1024),
        "common_http_protocol_options": {"max_headers_count": limits.max_header_count,
                                         "idle_timeout": "75s", "headers_with_underscores_action": "ALLOW"},
        "request_headers_timeout": _seconds(limits.header_timeout_s),
        "stream_idle_timeout": _seconds(config.upstream_idle_timeout_s),
        "preserve_external_request_id": True,
        "always_set_request_id_in_response": True,
    }
    listener = {
        "name": "kvfleet", "address": _address(host, port),
        # a body larger than this is refused (413) before the picker sees it
        "per_connection_buffer_limit_bytes": config.max_body_bytes,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [listener],
            "clusters": [_static_cluster(PICKER_CLUSTER, picker_port, http2=True), _engines_cluster(config),
                         _static_cluster(APP_CLUSTER, app_port)],
        },
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                                      "downstream_connections.v3.DownstreamConnectionsConfig",
                             "max_active_downstream_connections": limits.max_connections}}]},
    }
