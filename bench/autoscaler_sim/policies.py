"""The autoscaling policies the simulator compares: kvfleet's operator (the real recommend()), and Kubernetes HPA
on one external metric (KEDA's queue-length default, or the request rate). Every policy polls every 15 s. The
policies themselves live in kvfleet/autoscale_replay/policies.py, shared with `kvfleet bench autoscale`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from bench.autoscaler_sim.model import EngineModel, Policy
from kvfleet.autoscale_replay.policies import HpaPolicy, KvfleetPolicy
from kvfleet.autoscale_replay.policies import keda_queue as queue_length_hpa
from kvfleet.operator.autoscaler import AutoscalingPolicy

__all__ = ["HpaPolicy", "KvfleetPolicy", "policies", "queue_length_hpa", "request_rate_hpa", "sweep_variants"]


def request_rate_hpa(max_replicas: int, per_replica: float) -> HpaPolicy:
    return HpaPolicy(lambda v: v.arrivals_per_s, per_replica, max_replicas=max_replicas)


def policies(max_replicas: int, engine: EngineModel, rate_fraction: float) -> dict[str, Callable[[], Policy]]:
    """The compared policies, as factories (each simulation needs a fresh state)."""
    kvfleet = AutoscalingPolicy(min_replicas=1, max_replicas=max_replicas)
    return {
        "kvfleet (min 1)": lambda: KvfleetPolicy(kvfleet),
        "kvfleet (min 0)": lambda: KvfleetPolicy(replace(kvfleet, min_replicas=0)),
        "queue length (KEDA)": lambda: queue_length_hpa(max_replicas),
        "HPA on request rate": lambda: request_rate_hpa(max_replicas, rate_fraction * engine.capacity_rps),
    }


def sweep_variants(max_replicas: int) -> dict[str, AutoscalingPolicy]:
    """kvfleet policies with other parameters, for when the default misses the target."""
    default = AutoscalingPolicy(min_replicas=1, max_replicas=max_replicas)
    return {
        "targets KV 0.4, queue 1": replace(default, target_kv_cache_usage=0.4, target_queue_per_replica=1.0),
        "down window 60 s": replace(default, scale_down_stabilization_s=60.0),
        "up x4 per period": replace(default, max_scale_up_factor=4.0),
        **{f"min {n}": replace(default, min_replicas=n) for n in (8, 16, 20, 24)},
        "min 16, down window 60 s": replace(default, min_replicas=16, scale_down_stabilization_s=60.0),
    }
