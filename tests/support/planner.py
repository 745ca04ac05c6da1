"""Observations for the autoscaler's planner: a steady mix of classes at a pod's measured speed."""

from __future__ import annotations

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import ClassWindow
from kvfleet.operator.autoscaler import Observation, PodLoad

PREFILL, DECODE = 480.0, 116.0  # tokens/s a pod measures of itself

POD = PodLoad(0.3, 20, 0, 64, PREFILL, DECODE)

WORK_S = 136 / PREFILL + 64 / DECODE  # pod-seconds of one request of the shape below


def classes(rps: dict[Priority, float], queued: int = 0) -> dict[Priority, ClassWindow]:
    """What the gateways counted over a minute at these arrival rates (136 prompt and 64 output tokens each)."""
    out = {}
    for p in Priority:
        n = round(rps.get(p, 0.0) * 60)
        out[p] = ClassWindow(60.0, n, 136 * n, n, 64 * n, 0, (), queued if p is Priority.STANDARD else 0)
    return out


def observe(t: float, current: int, rps: dict[Priority, float], cold_start: float | None = 30.0,
            queued: int = 0) -> Observation:
    return Observation(t, current, (POD,) * current, queued, classes(rps, queued), cold_start)


STEADY = {Priority.CRITICAL: 1.0, Priority.STANDARD: 2.5, Priority.SHEDDABLE: 1.5}
