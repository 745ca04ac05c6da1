"""InferenceFleet's scalar spec fields, declared once: the CRD schema, the spec parser and AutoscalingPolicy's
defaults come from here (spec.engine's fields are the engine's own: kvfleet/fleet/engine_settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.fleet.slo_stats import SLOT_S, STATS_TTL_S
from kvfleet.fleet.vllm_serve import VLLM_IMAGE


@dataclass(frozen=True)
class FleetField:
    """One field: its camelCase name in the spec, the attribute it becomes, its schema type, default and bounds."""

    name: str
    attr: str
    kind: str  # the schema's type: "integer", "number" or "boolean"
    default: int | float | bool
    minimum: int | float | None = None
    maximum: int | float | None = None
    description: str = ""
    # The parser reads a number here even where the schema says integer (seconds in AutoscalingPolicy are floats).
    reads_float: bool = False

    def schema(self) -> dict:
        out: dict = {"type": self.kind}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        out["default"] = self.default
        if self.description:
            out["description"] = self.description
        return out


DEFAULT_IMAGE = "kvfleet/engine:cpu"
# spec.runtime: which server the engine pods run, and the image each uses when spec.image is left out
RUNTIMES = {"kvfleet": DEFAULT_IMAGE, "vllm": VLLM_IMAGE}
DEFAULT_RUNTIME = "kvfleet"

# spec.<name>, read onto FleetSpec.
SPEC_FIELDS = (
    FleetField("replicas", "replicas", "integer", 1, 0, 1000,
               "engine pods; the autoscaler writes it when autoscaling is enabled"),
    FleetField("drainSeconds", "drain_seconds", "integer", 30, 0, 3600,
               "how long an engine may finish in-flight requests when stopped"),
    FleetField("sloWindowSeconds", "slo_window_s", "integer", 600, SLOT_S, STATS_TTL_S - SLOT_S,
               "the window status.sloAttainment counts over (at most what the gateways' counts in Redis keep)"),
)

# spec.autoscaling.<name>; `enabled` goes onto FleetSpec, the rest onto AutoscalingPolicy.
AUTOSCALING_ENABLED = FleetField("enabled", "autoscaling_enabled", "boolean", False)
AUTOSCALING_FIELDS = (
    FleetField("minReplicas", "min_replicas", "integer", 1, 0, 1000, "0 lets an idle fleet scale to zero"),
    FleetField("maxReplicas", "max_replicas", "integer", 8, 1, 1000),
    FleetField("targetKVCacheUsage", "target_kv_cache_usage", "number", 0.7, 0.01, 1.0),
    FleetField("targetQueuePerReplica", "target_queue_per_replica", "number", 4.0, 0.1, 1e6),
    FleetField("tolerance", "tolerance", "number", 0.1, 0.0, 0.99),
    FleetField("scaleUpStabilizationSeconds", "scale_up_stabilization_s", "integer", 0, 0, 3600, reads_float=True),
    FleetField("scaleDownStabilizationSeconds", "scale_down_stabilization_s", "integer", 300, 0, 3600,
               reads_float=True),
    FleetField("scaleToZeroAfterSeconds", "scale_to_zero_idle_s", "integer", 300, 0, 86400, reads_float=True),
    FleetField("stableWindowSeconds", "stable_window_s", "integer", 60, 6, 3600,
               "the load a burst is measured against is its average over this window, the SLO planner reads "
               "each class's demand over it, and after a burst no scale-down for this long (Knative's stable "
               "window)", reads_float=True),
    FleetField("coldStartSeconds", "cold_start_s", "integer", 30, 0, 3600,
               "pod creation to ready, assumed until the operator has measured the fleet's own", reads_float=True),
    FleetField("criticalLane", "critical_lane", "boolean", False,
               description="plan one engine more while critical requests come, for the gateways' critical lane (their "
               "--critical-lane: that engine takes no lower-class requests)"),
)


def autoscaling_default(attr: str) -> int | float:
    """AutoscalingPolicy's default for `attr`, as the parser would read an absent field."""
    f = next(f for f in AUTOSCALING_FIELDS if f.attr == attr)
    return float(f.default) if f.reads_float or f.kind == "number" else f.default


def spec_default(attr: str) -> int | bool:
    """FleetSpec's default for `attr` (replicas, drain_seconds, autoscaling_enabled)."""
    return next(f.default for f in (*SPEC_FIELDS, AUTOSCALING_ENABLED) if f.attr == attr)
