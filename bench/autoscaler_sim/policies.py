"""The autoscaling policies the simulator compares: kvfleet's operator (the real recommend()), and Kubernetes HPA
on one external metric (KEDA's queue-length default, or the request rate). Every policy polls every 15 s."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from bench.autoscaler_sim.model import EngineModel, FleetView, Policy
from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, Observation, recommend


class KvfleetPolicy:
    """kvfleet's operator: recommend() on the ready pods' metrics and the gateway's queue."""

    def __init__(self, policy: AutoscalingPolicy) -> None:
        self.policy, self.state = policy, AutoscalerState()

    def desired(self, view: FleetView) -> int:
        obs = Observation(view.time, view.replicas, view.pods, view.gateway_queued)
        return recommend(obs, self.policy, self.state).desired


@dataclass
class HpaPolicy:
    """Kubernetes HPA on one external metric with an AverageValue target and the default behavior: tolerance,
    a scale-down window seeded with the initial size, scale-up at most max(+100 %, +4 pods) per period."""

    metric: Callable[[FleetView], float]
    target: float  # per replica
    min_replicas: int = 1
    max_replicas: int = 64
    tolerance: float = 0.1
    scale_down_stabilization_s: float = 300.0
    history: list[tuple[float, int]] = field(default_factory=list)

    def desired(self, view: FleetView) -> int:
        now, current = view.time, max(view.replicas, 1)
        if not self.history:
            self.history.append((now, view.replicas))
        total = self.metric(view)
        ratio = total / (self.target * current)
        raw = current if abs(ratio - 1) <= self.tolerance else math.ceil(total / self.target - 1e-9)
        raw = min(self.max_replicas, max(self.min_replicas, raw))
        self.history = [(t, r) for t, r in self.history if t > now - self.scale_down_stabilization_s]
        self.history.append((now, raw))
        if raw < current:
            raw = min(current, max(r for _, r in self.history))
        return min(raw, max(2 * current, current + 4))


def queue_length_hpa(max_replicas: int, per_replica: float = 5.0) -> HpaPolicy:
    """vLLM production-stack's KEDA default: sum(vllm:num_requests_waiting) / 5. Without kvfleet's gateway queue
    its router would have sent the gateway's queued requests to the engines, so they count as waiting."""
    return HpaPolicy(lambda v: sum(p.waiting or 0 for p in v.pods) + v.gateway_queued, per_replica,
                     max_replicas=max_replicas)


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
