"""Batch work as demand (pure): pods a fleet must add for its Batch API backlog to finish by each batch's deadline.

Batch requests run only in the capacity interactive traffic leaves (gateway/batch/capacity.py), so the backlog is
demand only when that leftover capacity cannot finish it in time: batches are taken earliest deadline first, and the
pods needed to finish each prefix of them by its deadline, starting after a cold start, are compared with the pods
interactive work leaves idle. While the leftover suffices the backlog adds nothing (it never holds replicas up
against the interactive plan, nor keeps an idle fleet from scaling down); at zero pods a batch waits until it needs
at least MIN_URGENT_PODS of a pod over its remaining window, so a day-long window does not start a pod at once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.operator.planner import Capacity

SAFETY = 1.25  # plan to finish with a quarter of the time to spare (stragglers, retries, a slower pod)
MIN_URGENT_PODS = 0.5  # at zero pods, the backlog starts one once it needs this much of a pod until its deadline
MAX_BATCHES = 10_000
STALE_S = 60.0


@dataclass(frozen=True)
class BatchBacklog:
    """One batch's unfinished requests as the gateway runner reports them."""

    remaining: int
    prompt_tokens: float  # mean per request (estimated from the request text)
    output_tokens: float  # mean per request (its max_tokens)
    deadline: float  # Unix seconds: the batch's expires_at


def parse_backlog(values: Iterable[bytes | str], now: float) -> list[BatchBacklog]:
    """The gateways' reports (JSON each; kvfleet/fleet/redis_keys.py batch_backlog_key); bad ones, and ones no
    runner has renewed for STALE_S (a replica that died; its batch's next runner reports it again), are skipped."""
    out = []
    for raw in values:
        try:
            d = json.loads(raw)
            item = BatchBacklog(int(d["remaining"]), float(d["prompt_tokens"]), float(d["output_tokens"]),
                                float(d["deadline"]))
            if not now - STALE_S <= float(d["reported_at"]) <= now + STALE_S:
                continue
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        if item.remaining > 0 and all(math.isfinite(v) and v >= 0 for v in (item.prompt_tokens,
                                                                            item.output_tokens, item.deadline)):
            out.append(item)
        if len(out) >= MAX_BATCHES:
            break
    return out


def batch_pods(backlog: list[BatchBacklog], capacity: Capacity, now: float, start_after_s: float,
               leftover_pods: float) -> tuple[float, str]:
    """(pods to add beyond the current fleet for the backlog, why); 0 while it finishes on time in leftover_pods."""
    if not backlog:
        return 0.0, ""
    need, work = 0.0, 0.0
    for item in sorted(backlog, key=lambda b: b.deadline):
        work += item.remaining * capacity.work_s(item.prompt_tokens, item.output_tokens)
        need = max(need, work * SAFETY / max(1.0, item.deadline - now - start_after_s))
    leftover = max(0.0, leftover_pods)
    if need <= leftover:
        return 0.0, f"batch backlog on time in the leftover {leftover:.2f} pods (needs {need:.2f})"
    if leftover == 0.0 and need < MIN_URGENT_PODS:
        return 0.0, f"batch backlog can wait (needs {need:.2f} of a pod until its deadlines)"
    return need - leftover, f"batch backlog at risk: {need:.2f} pods to finish by its deadlines, {leftover:.2f} left"
