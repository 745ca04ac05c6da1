"""The gateway's settings, checked once at start (CLI flags map onto these fields one to one)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvfleet.fleet.body_limit import DEFAULT_MAX_BODY_BYTES
from kvfleet.fleet.engine_settings import ENGINE_API_KEY_ENV
from kvfleet.fleet.http_limits import HttpLimits
from kvfleet.fleet.pods import ENGINE_PORT_NAME
from kvfleet.fleet.priority import PRIORITY_NAMES, Priority
from kvfleet.gateway.batch.settings import BatchSettings
from kvfleet.gateway.migration import DEFAULT_MIGRATION_LIMIT
from kvfleet.gateway.models.routes import ModelRoute
from kvfleet.gateway.queue.fair_order import QUEUE_POLICIES
from kvfleet.gateway.routing.pick import SaturationPolicy, ScoreWeights
from kvfleet.gateway.routing.strategies import STRATEGIES

ROUTING_STRATEGIES = tuple(STRATEGIES)  # the routing registry's names, in its order
# python: this process proxies; envoy: it runs Envoy as its child; envoy-sidecar: an Envoy beside it (the chart's
# sidecar, bootstrap from gateway/envoy/sidecar.py) calls its picker; picker: an Inference-Extension Gateway's does
DATA_PLANES = ("python", "envoy", "envoy-sidecar", "picker")
DEFAULT_PICKER_PORT = 9002  # the Gateway API Inference Extension's endpoint picker (EPP) port
DEFAULT_CAPS = {Priority.CRITICAL: 1000, Priority.STANDARD: 1000, Priority.SHEDDABLE: 100}
MAX_TENANT_METRICS_TOP = 1000  # tenants named in the per-tenant metrics: each adds a handful of series


@dataclass
class GatewayConfig:
    engines: list[str] = field(default_factory=list)  # static discovery
    # several models, each its own fleet (gateway/models/front.py); empty: one fleet, from engines or k8s_selector
    models: list[ModelRoute] = field(default_factory=list)
    k8s_namespace: str | None = None  # Kubernetes discovery (with k8s_selector)
    k8s_selector: str | None = None
    k8s_port_name: str = ENGINE_PORT_NAME
    # several models from Kubernetes: the InferenceFleets a label selector picks, or those named
    # (models/inference_fleets.py)
    k8s_fleet_selector: str | None = None
    k8s_fleets: list[str] = field(default_factory=list)
    fleet: str = "default"
    redis_url: str | None = None
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    routing: str = "kvfleet"
    tokenizer: str | None = None  # the engines' model: prompts are tokenized as they do, for the precise prefix index
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    saturation: SaturationPolicy = field(default_factory=SaturationPolicy)
    scrape_interval_s: float = 0.075
    default_max_queue_ms: float = 30_000.0
    max_queue_ms_limit: float = 600_000.0
    aging_ms: float = 10_000.0
    queue_policy: str = "fair"  # one of QUEUE_POLICIES: fair share among tenants inside a class, or fcfs
    queue_caps: dict[Priority, int] = field(default_factory=lambda: dict(DEFAULT_CAPS))
    # the degradation ladder's first rung: per class, the output cap while the fleet is saturated (none: off)
    degrade_max_tokens: dict[Priority, int] = field(default_factory=dict)
    tenant_max_queued: int | None = None  # per tenant, fleet-wide (a key's max_queued= overrides it)
    tenant_max_inflight: int | None = None  # per tenant, fleet-wide: admitted and unfinished
    eject_after_failures: int = 3
    eject_seconds: float = 10.0
    upstream_connect_timeout_s: float = 2.0
    # An engine answers headers after its first token (after the whole answer without streaming): generous, bounded.
    upstream_first_byte_timeout_s: float = 300.0
    upstream_idle_timeout_s: float = 60.0  # the longest gap between two chunks of an engine's answer
    engine_unreachable_after_s: float = 10.0  # /metrics timing out this long: unhealthy, and waits on it end
    # an answer its engine drops is continued on another engine, at most this many times (migration.py; 0: off)
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    engine_api_key: str | None = field(default=None, repr=False)  # sent upstream as `Authorization: Bearer <key>`
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    enable_docs: bool = False  # /docs, /redoc and /openapi.json
    data_plane: str = "envoy"  # one of DATA_PLANES; envoy falls back to python where no Envoy binary exists
    picker_port: int = DEFAULT_PICKER_PORT  # the picker's gRPC port with --data-plane picker or envoy-sidecar
    envoy_endpoints_file: str | None = None  # envoy-sidecar: the EDS file this process writes and the Envoy reads
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    forward_priority: bool = True  # set the body's `priority` (vLLM semantics) from the class
    critical_first: bool = True  # critical requests route past a saturated fleet while an engine has room for them
    # one engine takes no lower-class requests while critical ones come (routing/pick.py critical_lane); the
    # operator adds the engine it takes with the InferenceFleet's spec.autoscaling.criticalLane
    critical_lane: bool = False
    # the highest class a request may claim when its key sets no max_class (every request without API keys)
    max_class: Priority = Priority.CRITICAL
    api_keys_file: str | None = None
    api_keys_secret: str | None = None  # namespace/name of a Kubernetes Secret
    rpm_per_key: int | None = None
    tpm_per_key: int | None = None
    tenant_metrics_top: int = 20  # tenants with their own kvfleet_gateway_tenant_* series; the rest are "other"
    batch: BatchSettings | None = None  # the Batch API (gateway/batch/), on with --batch-dir

    @property
    def hands_off(self) -> bool:
        """Whether kvfleet's own Envoy (child or sidecar) hands each stream it can migrate to the gateway's app on
        loopback, which relays it from the engine and continues it elsewhere when the engine drops it
        (gateway/envoy/handoff.py): Envoy cannot splice a stream, and an engine's reset ends Envoy's stream to the
        client. Migration on, and an Envoy built from bootstrap.py."""
        return self.migration_limit > 0 and self.data_plane in ("envoy", "envoy-sidecar")

    @property
    def several_models(self) -> bool:
        """Whether a ModelFront serves several fleets (by `model`), not one Gateway one fleet."""
        return bool(self.models or self.k8s_fleets) or self.k8s_fleet_selector is not None

    def __post_init__(self) -> None:
        from kvfleet.gateway.engines.discovery import normalize_engine_url

        self.engines = [normalize_engine_url(url) for url in self.engines]
        fleets_from_k8s = self.k8s_fleet_selector is not None or bool(self.k8s_fleets)
        if fleets_from_k8s and (self.engines or self.k8s_selector or self.models):
            raise ValueError("--k8s-fleet/--k8s-fleet-selector find the models themselves: leave out --engine and "
                             "--k8s-selector")
        if fleets_from_k8s and not self.k8s_namespace:
            raise ValueError("--k8s-fleet and --k8s-fleet-selector need --k8s-namespace")
        if self.k8s_fleet_selector is not None and self.k8s_fleets:
            raise ValueError("use either --k8s-fleet-selector or --k8s-fleet, not both")
        if self.models and (self.engines or self.k8s_selector):
            raise ValueError("name every model's engines (--engine NAME=URL), or give one fleet's engines; not both")
        if self.engines and self.k8s_selector:
            raise ValueError("use either --engine (static) or --k8s-selector (Kubernetes discovery), not both")
        if self.k8s_selector and not self.k8s_namespace:
            raise ValueError("--k8s-selector needs --k8s-namespace")
        if self.routing not in ROUTING_STRATEGIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_STRATEGIES)}, not {self.routing!r}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"--data-plane must be one of {', '.join(DATA_PLANES)}, not {self.data_plane!r}")
        if not 1 <= self.picker_port <= 65535:
            raise ValueError(f"--picker-port must be a TCP port (1-65535), not {self.picker_port}")
        if (self.data_plane == "envoy-sidecar") != bool(self.envoy_endpoints_file):
            raise ValueError("--envoy-endpoints-file goes with --data-plane envoy-sidecar, and only with it")
        if not 0.05 <= self.scrape_interval_s <= 10:
            raise ValueError("--scrape-interval must be between 0.05 and 10 seconds")
        if not 0 <= self.default_max_queue_ms <= self.max_queue_ms_limit:
            raise ValueError(f"--max-queue-ms must be between 0 and {self.max_queue_ms_limit:.0f}")
        if self.aging_ms <= 0:
            raise ValueError("--aging-ms must be positive")
        if self.saturation.release_queue < 0:
            raise ValueError(f"--queue-release-depth must be a count >= 0, not {self.saturation.release_queue}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"--queue-policy must be one of {', '.join(QUEUE_POLICIES)}, not {self.queue_policy!r}")
        for flag, cap in (("--tenant-max-queued", self.tenant_max_queued),
                          ("--tenant-max-inflight", self.tenant_max_inflight)):
            if cap is not None and cap < 0:
                raise ValueError(f"{flag} must be a count >= 0 (or left out for no cap), not {cap}")
        for p, cap in self.queue_caps.items():
            if cap < 0:
                raise ValueError(f"the {p.value} queue cap must be >= 0, not {cap}")
        for p, cap in self.degrade_max_tokens.items():
            if cap < 1:
                raise ValueError(f"--degrade-max-tokens: the {p.value} cap must be a count of tokens >= 1, not {cap}")
        if self.eject_after_failures < 1 or self.eject_seconds < 0:
            raise ValueError("--eject-after-failures must be >= 1 and --eject-seconds >= 0")
        if not 0 <= self.migration_limit <= 100:
            raise ValueError(f"--migration-limit must be from 0 (off) to 100, not {self.migration_limit}")
        if self.upstream_first_byte_timeout_s <= 0 or self.upstream_idle_timeout_s <= 0:
            raise ValueError("--upstream-first-byte-timeout and --upstream-idle-timeout must be positive (seconds)")
        if self.engine_unreachable_after_s < 1:
            raise ValueError("--engine-unreachable-after must be at least 1 second (one scrape timeout)")
        if self.engine_api_key is not None and (not self.engine_api_key or not self.engine_api_key.isprintable()):
            raise ValueError(f"--engine-api-key ({ENGINE_API_KEY_ENV}) must be non-empty printable text")
        try:
            self.max_class = Priority(self.max_class)
        except ValueError:
            raise ValueError(f"--max-class must be one of {PRIORITY_NAMES}, not {self.max_class!r}") from None
        if self.api_keys_file and self.api_keys_secret:
            raise ValueError("use either --api-keys-file or --api-keys-secret, not both")
        if not 0 <= self.tenant_metrics_top <= MAX_TENANT_METRICS_TOP:
            raise ValueError(f"--tenant-metrics-top must be a whole number from 0 (every tenant is 'other') to "
                             f"{MAX_TENANT_METRICS_TOP}, not {self.tenant_metrics_top}")
        if self.batch is not None and not self.redis_url:
            raise ValueError("the Batch API (--batch-dir, --batch-store) needs --redis-url: batches and their "
                             "progress live in Redis, shared by every gateway replica")
        if not self.fleet or any(c in self.fleet for c in "{}: "):
            raise ValueError(f"--fleet must be a plain name (no braces, colons or spaces), not {self.fleet!r}")


def parse_queue_caps(text: str) -> dict[Priority, int]:
    """'critical=1000,standard=500,sheddable=0' (classes left out keep their defaults)."""
    return parse_class_counts(text, "--queue-caps", DEFAULT_CAPS)


def parse_class_counts(text: str, flag: str, defaults: dict[Priority, int] | None = None) -> dict[Priority, int]:
    """class=count pairs over `defaults` (classes left out keep theirs, or are absent)."""
    counts = dict(defaults or {})
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            counts[Priority(name.strip())] = int(value)
        except ValueError:
            raise ValueError(f"{flag} takes class=count pairs such as 'standard=500', not {part!r}") from None
    return counts
