"""How many engine pods a fleet should have: a pure function of what was observed and what was decided before.

When the pods report their measured capacity (kvfleet engines), or the fleet declares one pod's capacity
(spec.autoscaling.capacity, as profiled: vLLM pods do not measure theirs), and the gateways' per-class counts are
there, the SLO-class planner decides (operator/planner.py: pods in units of work per class over the measured cold
start, a standing margin for the critical class); the scale-down window then shortens to twice the cold start (at
least 60 s), and the burst rules and step caps below do not apply (the plan covers them). Otherwise (no capacity
known, no Redis) the load signals:

After Kubernetes' HPA: desired = ceil(current × observed / target) for each signal (KV-cache usage per pod,
waiting requests per replica including the gateway's queue), the larger wins; no change within the tolerance;
pods without metrics count as full when scaling down and as empty when scaling up; scale-up and scale-down
stabilization windows; at most ×2 up and ÷2 down per step (but always one pod); clamped to [min, max]; on KV
usage, a scale-down goes to ceil(n × ratio^0.5), since KV usage grows faster than load near saturation. After
Knative's KPA: a burst (the latest load ≥ 2× the stable-window average) scales up at once, without the ×2 cap,
and blocks scale-down for a while, and a fleet with minReplicas 0 goes to zero after an idle period and comes
back as soon as the gateway holds requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import DEFAULT_SLO_CLASSES, ClassWindow, SloClass
from kvfleet.operator.batch_demand import BatchBacklog, batch_pods
from kvfleet.operator.fleet_fields import autoscaling_default
from kvfleet.operator.planner import UTILIZATION, Capacity, PlannerMemory, measured_capacity, plan

PERIOD_ALLOWANCE_S = 15.0  # the planner's horizon: cold start + one decision period (the operator's default)
# With a plan, a scale-down waits the smaller of scaleDownStabilizationSeconds and this or twice the cold start: the
# plan's margin already covers what a long window would (replayed: 300 s cost 1.5-1.7x the oracle, 60 s 1.1-1.4x).
PLANNER_MIN_DOWN_WINDOW_S = 60.0


@dataclass(frozen=True)
class AutoscalingPolicy:
    # The fields an InferenceFleet sets take their defaults from its declaration (operator/fleet_fields.py).
    min_replicas: int = autoscaling_default("min_replicas")
    max_replicas: int = autoscaling_default("max_replicas")
    target_kv_cache_usage: float = autoscaling_default("target_kv_cache_usage")
    target_queue_per_replica: float = autoscaling_default("target_queue_per_replica")
    tolerance: float = autoscaling_default("tolerance")
    scale_up_stabilization_s: float = autoscaling_default("scale_up_stabilization_s")
    scale_down_stabilization_s: float = autoscaling_default("scale_down_stabilization_s")
    max_scale_up_factor: float = 2.0
    max_scale_down_factor: float = 2.0  # at most 2; a step always may remove one pod
    kv_scale_down_exponent: float = 0.5  # 1: HPA's proportional rule; below 1: gentler scale-down on KV usage
    panic_scale_up_factor: float = 1000.0  # KPA's max-scale-up-rate: in a burst, the ×2 cap does not apply
    panic_threshold: float = 2.0  # latest load / stable-window load that counts as a burst
    stable_window_s: float = autoscaling_default("stable_window_s")  # also the hold: no scale-down after a burst
    scale_to_zero_idle_s: float = autoscaling_default("scale_to_zero_idle_s")
    cold_start_s: float = autoscaling_default("cold_start_s")  # until measured (Observation.cold_start_s)
    critical_lane: bool = autoscaling_default("critical_lane")  # the planner adds the gateways' critical lane
    slo: Mapping[Priority, SloClass] = field(default_factory=lambda: dict(DEFAULT_SLO_CLASSES))
    planner_utilization: float = UTILIZATION  # work per pod the SLO planner aims at (a full batch is 1)
    capacity: Capacity | None = None  # one pod's, as declared; what the pods measure of their own wins

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be between 0 and maxReplicas "
                             f"({self.max_replicas})")
        if self.max_replicas < 1:
            raise ValueError("maxReplicas must be at least 1")
        if not 0 < self.target_kv_cache_usage <= 1:
            raise ValueError(f"targetKVCacheUsage must be in (0, 1], not {self.target_kv_cache_usage}")
        if self.target_queue_per_replica <= 0:
            raise ValueError(f"targetQueuePerReplica must be positive, not {self.target_queue_per_replica}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), not {self.tolerance}")
        if self.scale_up_stabilization_s < 0 or self.scale_down_stabilization_s < 0:
            raise ValueError("stabilization windows must be >= 0 seconds")
        if not (self.max_scale_up_factor > 1 and 1 < self.max_scale_down_factor <= 2
                and self.panic_scale_up_factor >= self.max_scale_up_factor):
            raise ValueError("scale factors must be > 1, the scale-down factor at most 2, and the burst factor at "
                             "least the scale-up factor")
        if not 0 < self.planner_utilization <= 1:
            raise ValueError(f"the planner's utilization must be in (0, 1], not {self.planner_utilization}")
        if not 0 < self.kv_scale_down_exponent <= 1:
            raise ValueError(f"the KV scale-down exponent must be in (0, 1], not {self.kv_scale_down_exponent}")


@dataclass(frozen=True)
class PodLoad:
    """One ready pod's scraped load; None where its /metrics could not be read."""

    kv_cache_usage: float | None
    running: int | None = None
    waiting: int | None = None
    # The capacity model's inputs (kvfleet engines export them; None where not exported or not measured yet).
    max_num_seqs: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s_full_batch: float | None = None

    @property
    def has_metrics(self) -> bool:
        return self.kv_cache_usage is not None and self.waiting is not None


@dataclass(frozen=True)
class Observation:
    time: float  # seconds, any monotonic origin
    current_replicas: int  # what the Deployment has now (spec)
    pods: tuple[PodLoad, ...]  # its ready pods
    gateway_queued: int = 0  # the fleet's requests waiting in the gateway queue (Redis)
    # What the gateways counted per class over the stable window (planner.demand_windows; kvfleet/fleet/slo.py);
    # empty when unknown.
    classes: Mapping[Priority, ClassWindow] = field(default_factory=dict)
    cold_start_s: float | None = None  # measured pod creation -> ready for this fleet; None: not measured yet
    recent_classes: Mapping[Priority, ClassWindow] = field(default_factory=dict)  # as classes, its last quarter
    batch: tuple[BatchBacklog, ...] = ()  # the Batch API's unfinished batches (operator/batch_demand.py)
    # the warm pool: replicas asleep with the model loaded (engine sleep mode), ready again in wake_s
    warm_replicas: int = 0
    wake_s: float | None = None


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    kv_cache_usage: float | None  # average over pods with metrics
    queue_per_replica: float
    panic: bool = False
    plan: dict | None = None  # the SLO planner's inputs, when it decided

    def inputs(self) -> dict:
        out = {"kvCacheUsage": None if self.kv_cache_usage is None else round(self.kv_cache_usage, 3),
               "queuePerReplica": round(self.queue_per_replica, 2), "panic": self.panic}
        return out | ({"plan": self.plan} if self.plan else {})


@dataclass
class AutoscalerState:
    """What one fleet's autoscaler remembers between periods; the operator keeps it in the fleet's status
    (as_status, from_status), so a restarted operator decides as the old one would have."""

    recommendations: list[tuple[float, int]] = field(default_factory=list)
    loads: list[tuple[float, float]] = field(default_factory=list)  # (time, load) for the burst detector
    panic_until: float = -math.inf
    last_busy: float | None = None
    planner: PlannerMemory = field(default_factory=PlannerMemory)

    @property
    def observed_at(self) -> float:
        """When the latest observation this state has seen was made (-inf when fresh)."""
        return self.loads[-1][0] if self.loads else -math.inf

    def as_status(self) -> dict[str, Any]:
        """JSON for status.autoscaler. Of a run of equal recommendations only the latest is kept: every window
        that ends now has the same highest and lowest recommendation either way."""
        recs = self.recommendations
        kept = [(t, r) for i, (t, r) in enumerate(recs) if i + 1 == len(recs) or recs[i + 1][1] != r]
        out: dict[str, Any] = {"recommendations": [[round(t, 3), r] for t, r in kept],
                               "loads": [[round(t, 3), v] for t, v in self.loads]}
        if self.panic_until > -math.inf:
            out["panicUntil"] = round(self.panic_until, 3)
        if self.last_busy is not None:
            out["lastBusy"] = round(self.last_busy, 3)
        out["planner"] = self.planner.as_status()
        return out

    @classmethod
    def from_status(cls, saved: Mapping[str, Any] | None) -> AutoscalerState:
        """as_status() read back; a missing or malformed field starts fresh (as HPA does after a restart)."""
        saved = saved or {}
        try:
            return cls([(float(t), int(r)) for t, r in saved.get("recommendations") or []],
                       [(float(t), float(v)) for t, v in saved.get("loads") or []],
                       float(saved.get("panicUntil", -math.inf)),
                       None if saved.get("lastBusy") is None else float(saved["lastBusy"]),
                       PlannerMemory.from_status(saved.get("planner")))
        except (TypeError, ValueError, AttributeError):
            return cls()


def hpa_desired(values: list[float], missing: int, target: float, tolerance: float, extra: float = 0.0) -> int:
    """Kubernetes HPA for one signal: values from the pods with metrics (plus `extra`, load not tied to a pod),
    averaged over all pods; pods without metrics are filled in against the direction of the change (as empty
    when scaling up, as at target when scaling down), and a change that the fill-in cancels or reverses is
    dropped."""
    total = len(values) + missing
    if total == 0:
        return 0
    if not values:
        ratio = (extra / total) / target
        return total if ratio <= 1 + tolerance else math.ceil(total * ratio - 1e-9)
    ratio = (sum(values) + extra) / len(values) / target
    if not missing:
        return len(values) if abs(ratio - 1) <= tolerance + 1e-9 else math.ceil(len(values) * ratio - 1e-9)
    if abs(ratio - 1) <= tolerance + 1e-9:
        return total
    fill = 0.0 if ratio > 1 else target
    new_ratio = (sum(values) + extra + fill * missing) / total / target
    if abs(new_ratio - 1) <= tolerance + 1e-9 or (new_ratio > 1) != (ratio > 1):
        return total
    return math.ceil(total * new_ratio - 1e-9)


def _signal_desired(n: int, kv_values: list[float], waiting: list[int], missing: int, queued: int,
                    policy: AutoscalingPolicy) -> tuple[int, float | None, float]:
    """HPA on KV usage and on queue per replica (the gateway's queue included); the larger wins."""
    total = n + missing
    kv_cache_usage_avg = sum(kv_values) / len(kv_values) if kv_values else None
    queue = (sum(waiting) + queued) / max(total, 1)
    wanted = [hpa_desired([float(w) for w in waiting], missing, policy.target_queue_per_replica, policy.tolerance,
                          extra=float(queued))]
    if kv_values:
        wanted.append(_kv_desired(kv_values, missing, policy))
    return max(wanted), kv_cache_usage_avg, queue


def _kv_desired(kv_values: list[float], missing: int, policy: AutoscalingPolicy) -> int:
    """HPA on KV usage, but a scale-down goes only to ceil(n × ratio^e): KV usage grows faster than load near
    saturation (each request stays longer in a fuller batch), so the proportional rule would shrink a busy fleet
    too far and saturate it (bench/autoscaler_sim/: e = 0.5 took the SLO outside bursts from 91.6 % to 96.9 %)."""
    desired = hpa_desired(kv_values, missing, policy.target_kv_cache_usage, policy.tolerance)
    total = len(kv_values) + missing
    if desired >= total:
        return desired
    ratio = sum(kv_values) / len(kv_values) / policy.target_kv_cache_usage
    return max(desired, math.ceil(total * ratio ** policy.kv_scale_down_exponent - 1e-9))


def load_level(obs: Observation) -> float:
    """One number for the burst detector: requests in the system (running + waiting + gateway-queued)."""
    return float(sum((p.running or 0) + (p.waiting or 0) for p in obs.pods) + obs.gateway_queued)


def recommend(obs: Observation, policy: AutoscalingPolicy, state: AutoscalerState) -> Decision:
    """The replica count to set now; updates state (recommendation history, burst and idle tracking)."""
    now, current = obs.time, obs.current_replicas
    with_metrics = [p for p in obs.pods if p.has_metrics]
    missing = max(0, current - len(with_metrics)) if current else 0
    kv_values = [p.kv_cache_usage for p in with_metrics]
    waiting = [p.waiting for p in with_metrics]
    level = load_level(obs)
    if level > 0 or any(v > 0.01 for v in kv_values):
        state.last_busy = now
    elif state.last_busy is None:
        state.last_busy = now

    # A burst: the latest load at least panic_threshold × the stable window's average.
    state.loads = [(t, v) for t, v in state.loads if t > now - policy.stable_window_s] + [(now, level)]
    stable = sum(v for _, v in state.loads) / len(state.loads)
    burst = level > 0 and len(state.loads) > 1 and level >= policy.panic_threshold * max(stable, 1e-9)
    if burst:
        state.panic_until = now + policy.stable_window_s
    # a stable window shortened since the burst (the fleet's spec edited) bounds the hold from now on, as a changed
    # HPA behavior applies at its next sync
    state.panic_until = min(state.panic_until, now + policy.stable_window_s)
    panic = now < state.panic_until

    learned = state.planner.learn_capacity(measured_capacity(
        (p.prefill_tokens_per_s, p.decode_tokens_per_s_full_batch) for p in obs.pods))
    capacity = learned if learned is not None else policy.capacity
    planned = None
    cold_start = obs.cold_start_s if obs.cold_start_s is not None else policy.cold_start_s
    # new replicas serve after a cold start, or after a wake while the warm pool has replicas asleep
    first_start = obs.wake_s if obs.warm_replicas > 0 and obs.wake_s is not None else cold_start
    start_after = min(cold_start, first_start) + PERIOD_ALLOWANCE_S

    def batch_extra(leftover_pods: float) -> tuple[float, str]:
        if not obs.batch or capacity is None:
            return 0.0, ""
        return batch_pods(list(obs.batch), capacity, now, start_after, leftover_pods)

    if current == 0:
        desired, reason = _from_zero(obs, policy)
        extra, why = batch_extra(0.0)
        if extra > 0 and math.ceil(extra) > desired:
            desired, reason = math.ceil(extra), f"{why}: scale from zero"
        kv_cache_usage_avg, queue = None, float(obs.gateway_queued)
    elif obs.classes and capacity is not None:
        horizon = start_after
        waiting_in_pods = sum(p.waiting or 0 for p in with_metrics)
        planned = plan(now, obs.classes, capacity, waiting_in_pods, horizon, policy.slo, state.planner,
                       policy.planner_utilization, obs.recent_classes, policy.critical_lane)
        kv_cache_usage_avg = sum(kv_values) / len(kv_values) if kv_values else None
        queue = (sum(waiting) + obs.gateway_queued) / max(current, 1)
        interactive = sum(planned.inputs["workPods"].values())
        extra, why = batch_extra(current * policy.planner_utilization - interactive)
        raw = max(1, math.ceil(planned.pods + extra - 1e-9))
        direction = "up" if raw > current else "down" if raw < current else "hold"
        planned.inputs["batchPods"] = round(extra, 3)
        desired, reason = _idle(raw, f"{direction}: {planned.reason}" + (f"; {why}" if why else ""), now, level,
                                policy, state, busy=extra > 0)
    else:
        raw, kv_cache_usage_avg, queue = _signal_desired(len(with_metrics), kv_values, waiting, missing,
                                                         obs.gateway_queued, policy)
        reason = _reason(raw, current, kv_cache_usage_avg, queue, policy)
        if missing:
            reason += f"; {missing} pod(s) without metrics"
        extra, why = batch_extra(float(current - raw))  # the pods the load signals leave to batch work
        if extra > 0:
            raw, reason = raw + math.ceil(extra), f"{reason}; {why}"
        desired, reason = _idle(max(1, raw), reason, now, level, policy, state, busy=extra > 0)  # zero: when idle

    if planned is not None:  # the plan already covers bursts and the cold start: no burst rules, no step caps
        window = min(policy.scale_down_stabilization_s, max(PLANNER_MIN_DOWN_WINDOW_S, 2 * cold_start))
        desired = _stabilize(desired, current, now, replace(policy, scale_down_stabilization_s=window), state,
                             True, False)
    else:
        desired = _stabilize(desired, current, now, policy, state, burst, panic)
    if desired < current and panic and planned is None:
        desired, reason = current, "burst hold: no scale-down right after a burst"
    if current > 0 and desired > 0 and planned is None:
        up_factor = policy.panic_scale_up_factor if burst else policy.max_scale_up_factor
        desired = min(desired, max(current + 1, math.floor(current * up_factor)))
        desired = max(desired, min(current - 1, math.ceil(current / policy.max_scale_down_factor)))
    floor = policy.min_replicas if not (desired == 0 and policy.min_replicas == 0) else 0
    clamped = min(policy.max_replicas, max(floor, desired))
    if clamped != desired:
        reason += f" (clamped to [{policy.min_replicas}, {policy.max_replicas}])"
    if burst and clamped > current:
        reason = "burst: " + reason
    return Decision(clamped, reason, kv_cache_usage_avg, queue, panic, planned.inputs if planned else None)


def _idle(desired: int, reason: str, now: float, level: float, policy: AutoscalingPolicy,
          state: AutoscalerState, busy: bool = False) -> tuple[int, str]:
    """Zero, with minReplicas 0, once nothing has been in the system for scaleToZeroAfterSeconds (and no batch
    backlog is at risk: `busy`)."""
    idle_for = now - (state.last_busy if state.last_busy is not None else now)
    if policy.min_replicas == 0 and level == 0 and not busy and idle_for >= policy.scale_to_zero_idle_s:
        return 0, f"idle for {idle_for:.0f} s: scale to zero"
    return desired, reason


def _from_zero(obs: Observation, policy: AutoscalingPolicy) -> tuple[int, str]:
    if obs.gateway_queued > 0:
        n = max(1, math.ceil(obs.gateway_queued / policy.target_queue_per_replica))
        return n, f"{obs.gateway_queued} request(s) queued at the gateway: scale from zero"
    return max(0, policy.min_replicas), "no demand"


def _reason(raw: int, current: int, kv: float | None, queue: float, policy: AutoscalingPolicy) -> str:
    kv_text = "no KV metrics" if kv is None else f"KV usage {kv:.2f} vs target {policy.target_kv_cache_usage:.2f}"
    q_text = f"queue {queue:.1f}/replica vs target {policy.target_queue_per_replica:g}"
    if raw == current:
        return f"within tolerance: {kv_text}, {q_text}"
    return f"{'up' if raw > current else 'down'}: {kv_text}, {q_text}"


def _stabilize(desired: int, current: int, now: float, policy: AutoscalingPolicy, state: AutoscalerState,
               burst: bool, panic: bool) -> int:
    """HPA's windows: scale down only to the highest recommendation of the down window, and up only to the
    lowest of the up window (a burst skips the up window)."""
    horizon = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    if not state.recommendations:  # as HPA: a fresh history starts at the current size (no restart scale-down)
        state.recommendations.append((now, current))
    state.recommendations = [(t, r) for t, r in state.recommendations if t > now - horizon]
    state.recommendations.append((now, desired))
    if desired < current:
        window = [r for t, r in state.recommendations if t >= now - policy.scale_down_stabilization_s]
        return min(current, max(window))
    if desired > current and not burst and policy.scale_up_stabilization_s > 0:
        window = [r for t, r in state.recommendations if t >= now - policy.scale_up_stabilization_s]
        return max(current, min(window))
    return desired
