"""The reactive autoscalers a replay compares, each as it acts on the fleet it sees: kvfleet's operator (its real
recommend()), and Kubernetes HPA on one metric as vLLM production-stack's KEDA recipe (waiting requests) or on KV
usage. Knative's KPA is in kpa.py, the oracle in oracle.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.autoscale_replay.fleet import FleetView
from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, Observation, recommend


class KvfleetPolicy:
    """kvfleet's operator: recommend() on the ready pods' metrics and the gateway's queue."""

    def __init__(self, policy: AutoscalingPolicy) -> None:
        self.policy, self.state = policy, AutoscalerState()

    def desired(self, view: FleetView) -> int:
        obs = Observation(view.time, view.replicas, view.pods, view.gateway_queued, view.classes, view.cold_start_s,
                          view.recent_classes, view.batch, view.warm, view.wake_s)
        return recommend(obs, self.policy, self.state).desired


@dataclass
class HpaPolicy:
    """Kubernetes HPA on one metric with an AverageValue target and the default behavior: tolerance, a scale-down
    window seeded with the initial size, scale-up at most max(+100 %, +4 pods) per period."""

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


def keda_queue(max_replicas: int, per_replica: float = 5.0) -> HpaPolicy:
    """vLLM production-stack's KEDA recipe: sum(vllm:num_requests_waiting) / 5 per replica. Without kvfleet's
    gateway queue its router would have sent the gateway's queued requests to the engines, so they count as
    waiting."""
    return HpaPolicy(lambda v: sum(p.waiting or 0 for p in v.pods) + v.gateway_queued, per_replica,
                     max_replicas=max_replicas)


def hpa_kv(max_replicas: int, target: float = 0.7) -> HpaPolicy:
    """HPA on the pods' KV-cache usage (vllm:gpu_cache_usage_perc), target 0.7 on average; the metric is the sum
    over ready pods, so pods not ready yet count as empty (as HPA's missing-metric rule does when scaling up)."""
    return HpaPolicy(lambda v: sum(p.kv_cache_usage or 0.0 for p in v.pods), target, max_replicas=max_replicas)
