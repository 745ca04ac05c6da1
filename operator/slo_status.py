"""InferenceFleet status.sloAttainment: each class's objective and what the gateways counted of it over the status
window (kvfleet/fleet/slo_stats.py reads the counts). Pure, so the status a user reads is tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import ClassWindow, SloClass


def slo_attainment_status(slo: Mapping[Priority, SloClass], classes: Mapping[Priority, ClassWindow],
                          window_s: float) -> dict[str, dict[str, Any]]:
    """Per class: the objective (ttftSeconds, target), the share of its requests that met it (attained; None
    without answered or shed requests, a shed request counting as a miss), requests that arrived and were shed,
    and the seconds the counts cover (windowSeconds; the window asked for when nothing was counted)."""
    out = {}
    for priority in Priority:
        objective = slo[priority]
        window = classes.get(priority) or ClassWindow(window_s)
        attained = window.attainment(objective)
        out[priority.value] = {
            "ttftSeconds": objective.ttft_s, "target": objective.attainment,
            "attained": None if attained is None else round(attained, 5),
            "requests": window.arrivals, "shed": window.shed, "windowSeconds": round(window.window_s, 1)}
        if objective.tpot_s is not None:
            out[priority.value]["tpotSeconds"] = objective.tpot_s
    return out
