"""The SLO-class planner: how many engine pods each priority class's objective needs over the next cold start, in
units of work (pod-seconds at a full batch), from what the gateways counted of each class and what the engines
measured of themselves. Pure; autoscaler.recommend() calls it and keeps its memory (PlannerMemory) in the status.

- Capacity, learned online: a request of p prompt and o output tokens keeps a pod busy p / P + o / D seconds at a
  full batch, P and D the prefill tokens/s and full-batch decode tokens/s the engines report (a moving average, so
  one odd scrape moves it little, and kept across restarts).
- Demand per class: arrivals/s × that work over the fleet's stable window (stableWindowSeconds, a minute by
  default, as Knative's), sampled every decision (and over its last quarter where that is higher, for the classes
  with a target: as Knative's panic window, a burst's onset counts at once);
  the work waiting in the gateway queue and the engines' queues is added as what must drain within the horizon.
- Horizon: a pod ordered now serves after the measured cold start (or the warm pool's wake), so the plan covers
  that + one period: a class with a target at the larger of its level now and its forecast over the horizon (Holt's
  smoothing per class, operator/forecast.py, whose error each decision reports).
- Headroom only where it is needed: the classes that cannot wait (an attainment target) get a standing margin
  sized from the recent spread of their demand (mean + z·σ over the memory, z from the strictest target), so a
  burst that outruns the cold start is absorbed; best-effort classes are planned at their level, without margin,
  and give way (the engines run the other classes first and the gateway sheds them under pressure).
- Scale-down only when the plan stays below the fleet for the whole stabilization window (the highest plan in it
  wins), so a lull shorter than the window never drains pods that the next burst needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from statistics import NormalDist

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import ClassWindow, SloClass
from kvfleet.fleet.slo_stats import SLOT_S
from kvfleet.operator.forecast import ClassForecast, forecasts_status

RECENT_FRACTION = 0.25  # the short window (Observation.recent_classes) as a part of the demand window
CAPACITY_SMOOTHING = 0.2  # weight of a new capacity reading in the moving average
MEMORY_S = 1200.0  # how much demand history sizes the standing margin (bursts recur on this scale)
MAX_Z = 3.5  # the margin's z for the strictest target, capped (99.98 %)
UTILIZATION = 0.9  # work per pod the plan aims at (replayed: 0.85 cost 4-8 % more for 0-3 points of standard)
# A class with a target this strict never rests on one pod while it has traffic (N+1: one pod's restart or a burst in
# its prompt queue would cost more than the target allows).
REDUNDANT_TARGET = 0.999
MIN_REDUNDANT_PODS = 2


@dataclass(frozen=True)
class Capacity:
    """One pod's measured capacity: prefill tokens/s and decode tokens/s at a full batch."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def work_s(self, prompt_tokens: float, output_tokens: float) -> float:
        """Seconds of a pod at a full batch that one request of this shape takes."""
        return prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s


def measured_capacity(readings: Iterable[tuple[float | None, float | None]]) -> Capacity | None:
    """The pods' (prefill tokens/s, full-batch decode tokens/s) readings, each averaged over the pods that have
    measured it; None until both have been measured somewhere."""
    readings = list(readings)
    prefill = [p for p, _ in readings if p and p > 0 and math.isfinite(p)]
    decode = [d for _, d in readings if d and d > 0 and math.isfinite(d)]
    if not prefill or not decode:
        return None
    return Capacity(sum(prefill) / len(prefill), sum(decode) / len(decode))


@dataclass
class PlannerMemory:
    """What the planner remembers between decisions (saved in the fleet's status)."""

    capacity: Capacity | None = None
    # (time, work/s per class in the Priority order) at each decision, over MEMORY_S
    demand: list[tuple[float, tuple[float, ...]]] = field(default_factory=list)
    forecasts: dict[Priority, ClassForecast] = field(default_factory=dict)  # the classes with a target

    def learn_capacity(self, reading: Capacity | None) -> Capacity | None:
        if reading is not None:
            old = self.capacity
            self.capacity = reading if old is None else Capacity(
                old.prefill_tokens_per_s + CAPACITY_SMOOTHING * (reading.prefill_tokens_per_s
                                                                  - old.prefill_tokens_per_s),
                old.decode_tokens_per_s + CAPACITY_SMOOTHING * (reading.decode_tokens_per_s
                                                                 - old.decode_tokens_per_s))
        return self.capacity

    def as_status(self) -> dict:
        # Unrounded (JSON keeps a float exactly): a restarted operator must decide exactly as this one would.
        out: dict = {"demand": [[t, *ws] for t, ws in self.demand],
                     "forecast": {p.value: f.as_status() for p, f in self.forecasts.items()}}
        if self.capacity is not None:
            out["capacity"] = {"prefillTokensPerSecond": self.capacity.prefill_tokens_per_s,
                               "decodeTokensPerSecond": self.capacity.decode_tokens_per_s}
        return out

    @classmethod
    def from_status(cls, saved: Mapping | None) -> PlannerMemory:
        saved = saved or {}
        try:
            cap = saved.get("capacity")
            capacity = None if not cap else Capacity(float(cap["prefillTokensPerSecond"]),
                                                     float(cap["decodeTokensPerSecond"]))
            if capacity is not None and not (capacity.prefill_tokens_per_s > 0 and capacity.decode_tokens_per_s > 0):
                capacity = None
            demand = [(float(row[0]), tuple(float(w) for w in row[1:1 + len(Priority)])) for row in
                      saved.get("demand") or []]
            if any(len(ws) != len(Priority) for _, ws in demand):
                demand = []
            saved_forecasts = saved.get("forecast") or {}
            forecasts = {p: ClassForecast.from_status(saved_forecasts[p.value]) for p in Priority
                         if isinstance(saved_forecasts, Mapping) and p.value in saved_forecasts}
        except (TypeError, ValueError, KeyError, AttributeError, IndexError):
            return cls()
        return cls(capacity, demand, forecasts)


@dataclass(frozen=True)
class Plan:
    pods: float  # pods the classes need now (fractional; the caller rounds up)
    reason: str
    inputs: dict


def class_work(window: ClassWindow, capacity: Capacity, fallback: ClassWindow | None = None) -> float:
    """Pods a class keeps busy at a full batch: its arrivals/s × the work of its mean request."""
    if not window.arrivals:
        return 0.0
    prompt = window.mean_prompt_tokens or 0.0
    output = window.mean_output_tokens
    if output is None and fallback is not None:
        output = fallback.mean_output_tokens
    return window.arrivals_per_s * capacity.work_s(prompt, output or 0.0)


def margin_z(objective: SloClass) -> float:
    """The standing margin's z for a class: the normal quantile of its attainment target (0 for best effort)."""
    if objective.best_effort:
        return 0.0
    return min(MAX_Z, NormalDist().inv_cdf(objective.attainment))


def demand_windows(stable_window_s: float) -> tuple[float, float]:
    """The seconds of per-class counts a plan reads (Observation.classes: the fleet's stable window) and of their
    short window (Observation.recent_classes), never shorter than one of the counts' slots."""
    return stable_window_s, max(float(SLOT_S), stable_window_s * RECENT_FRACTION)


def plan(now: float, classes: Mapping[Priority, ClassWindow], capacity: Capacity, waiting_requests: int,
         horizon_s: float, slo: Mapping[Priority, SloClass], memory: PlannerMemory,
         utilization: float = UTILIZATION, recent: Mapping[Priority, ClassWindow] | None = None,
         critical_lane: bool = False) -> Plan:
    """The pods the fleet needs now for every class's objective over the horizon; records the demand sample. With
    `critical_lane`, one pod more while critical requests come: the gateways keep one engine free of lower-class
    requests then (--critical-lane), so the others must carry the plan."""
    order = list(Priority)
    everyone = ClassWindow(60.0, *(sum(getattr(w, f) for w in classes.values()) for f in
                                   ("arrivals", "prompt_tokens", "completed", "output_tokens", "shed")))
    work = tuple(class_work(classes.get(p, ClassWindow(60.0)), capacity, everyone) for p in order)
    # The last seconds' rate, where it is higher, for the classes with a target (as KPA's panic window).
    now_work = tuple(max(w, class_work(recent[p], capacity, everyone)) if recent and p in recent
                     and not slo[p].best_effort else w for p, w in zip(order, work, strict=True))
    memory.demand = [(t, w) for t, w in memory.demand if t > now - MEMORY_S] + [(now, work)]

    needed = 0.0  # pods, cumulative over the classes in priority order: a class is served after those above it
    parts = []
    level_sum = 0.0
    forecast: dict[str, float] = {}
    for k, p in enumerate(order):
        history = [ws[k] for _, ws in memory.demand]
        level = now_work[k]
        upper = level
        if not slo[p].best_effort:  # a class with a target is planned at its forecast over the horizon
            ahead = memory.forecasts.setdefault(p, ClassForecast()).step(now, level, horizon_s)
            forecast[p.value] = ahead
            upper = max(level, ahead)
        if k == 0:  # and the first class, which cannot wait, keeps a standing margin for its own bursts
            mean = sum(history) / len(history)
            spread = math.sqrt(sum((h - mean) ** 2 for h in history) / len(history))
            upper = max(upper, mean + margin_z(slo[p]) * spread)
        # A class is served after those above it: its need is their level plus its own forecast (the margin of a
        # class covers its own variance, not again the others').
        needed = max(needed, (level_sum + upper) / utilization)
        level_sum += level
        parts.append(f"{p.value} {level:.2f}->{upper:.2f}")
    if any(slo[p].attainment >= REDUNDANT_TARGET and work[k] > 0 for k, p in enumerate(order)):
        needed = max(needed, float(MIN_REDUNDANT_PODS))
    # What waits must drain within the standard objective's span of a decision period: as pods of work.
    mean_request = capacity.work_s(everyone.mean_prompt_tokens or 0.0, everyone.mean_output_tokens or 0.0)
    queued = sum(w.queued for w in classes.values()) + waiting_requests
    drain = queued * mean_request / max(horizon_s, 1.0)
    needed += drain
    lane = critical_lane and classes.get(Priority.CRITICAL, ClassWindow(60.0)).arrivals > 0
    needed += lane
    reason = (f"plan {needed:.2f} pods: work in pods now->over {horizon_s:.0f} s " + ", ".join(parts)
              + (f"; {queued} waiting, {drain:.2f} pods to drain" if queued else "")
              + ("; 1 pod for the critical lane" if lane else ""))
    inputs = {"workPods": {p.value: round(w, 3) for p, w in zip(order, work, strict=True)},
              "waiting": queued, "horizonSeconds": round(horizon_s, 1), "plannedPods": round(needed, 2),
              "criticalLanePods": int(lane),
              "forecast": forecasts_status({p.value: memory.forecasts[p] for p in order if p in memory.forecasts},
                                           forecast, horizon_s)}
    return Plan(needed, reason, inputs)
