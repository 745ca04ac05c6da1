"""The oracle: a replica schedule planned with the whole trace known in advance, the cheapest found that meets
each class's attainment target in the same simulator, under the same cold start, among the requests any policy could
serve in time (a request whose prefill alone exceeds its objective is missed whatever the replicas: slo.feasible).

How it plans: the trace is cut into 15 s buckets; a bucket needs the pods that the work arriving over the last
minute (prefill plus decode at a full batch, for the classes with a target) keeps busy at a utilization rho; each
pod is ordered one cold start before the first bucket that needs it and kept while any bucket within a cold start
ahead does. For each rho of a grid it simulates the schedule and adds a pod to the buckets (and the one before)
where a class missed its target, until the targets are met; then it tries to take one pod off each 5-minute
stretch of the cheapest schedule, keeping what still meets them.

What it guarantees: the schedule it returns was simulated and meets the targets (unless `meets_targets` says
otherwise: maxReplicas everywhere did not suffice), and its replica-seconds are those the simulation counted.
What it does not: that no cheaper schedule exists. It is a search, not a proof; `work_bound_replica_seconds`, the
pod-seconds of the trace's target classes' work at a full batch, is a floor that no policy can go below when it
serves that work within the trace, so the truth lies between the two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.autoscale_replay.engine_model import EngineModel, Request
from kvfleet.autoscale_replay.fleet import FleetView, Run
from kvfleet.autoscale_replay.slo import Slo, feasible

BUCKET_S = 15
WINDOW_S = 60  # a request stays ~a minute in a full batch: its work spreads over that long
RHOS = (1.0, 0.85, 0.7, 0.55, 0.4)
MAX_REPAIRS = 12
TRIM_BUCKETS = 20  # 5 minutes


@dataclass
class Schedule:
    """A policy that sets the replicas from a plan per bucket, ordering each pod a cold start ahead."""

    needs: list[int]
    cold_start_s: int

    def desired(self, view: FleetView) -> int:
        first = int(view.time) // BUCKET_S
        last = (int(view.time) + self.cold_start_s) // BUCKET_S
        return max(self.needs[min(first, len(self.needs) - 1):last + 1] or [self.needs[-1]])


@dataclass(frozen=True)
class OraclePlan:
    run: Run
    needs: list[int]
    meets_targets: bool
    simulations: int
    work_bound_replica_seconds: float


Simulator = Callable[[Schedule], Run]


def plan(requests: list[Request], duration_s: int, engine: EngineModel, slo: Slo, max_replicas: int,
         simulate: Simulator) -> OraclePlan:
    """The cheapest schedule found that meets the targets (simulate runs a schedule on a fresh copy of the trace)."""
    buckets = max(1, math.ceil(duration_s / BUCKET_S))
    busy = [0.0] * buckets
    for r in requests:
        if slo.attainment[r.priority] > 0:
            busy[min(buckets - 1, int(r.arrival) // BUCKET_S)] += r.prefill_s + r.work / engine.decode_rps[-1]
    bound = sum(busy)
    counter = [0]

    def run(needs: list[int]) -> tuple[Run, bool, list[int]]:
        counter[0] += 1
        result = simulate(Schedule(needs, engine.cold_start_s))
        return result, slo.met(feasible(result, slo)[1]), _missed_buckets(result, slo, buckets)

    best: tuple[int, list[int], Run] | None = None
    fallback: tuple[list[int], Run] | None = None
    for rho in RHOS:
        needs = _needs(busy, rho, max_replicas)
        for _ in range(MAX_REPAIRS):
            result, ok, missed = run(needs)
            if ok or not missed or all(needs[b] >= max_replicas for b in missed):
                break
            for b in missed:
                for k in (b - 1, b):
                    if k >= 0:
                        needs[k] = min(max_replicas, needs[k] + 1)
        fallback = (needs, result)  # the last, most generous rho's
        if ok and (best is None or sum(result.pods) < best[0]):
            best = (sum(result.pods), list(needs), result)
    if best is None:
        needs, result = fallback if fallback else ([max_replicas] * buckets, simulate(Schedule([max_replicas], 0)))
        return OraclePlan(result, needs, False, counter[0], bound)
    cost, needs, result = best
    for start in range(0, buckets, TRIM_BUCKETS):
        trial = [n - 1 if start <= b < start + TRIM_BUCKETS and n > 1 else n for b, n in enumerate(needs)]
        if trial == needs:
            continue
        trial_run, ok, _ = run(trial)
        if ok and sum(trial_run.pods) < cost:
            cost, needs, result = sum(trial_run.pods), trial, trial_run
    return OraclePlan(result, needs, True, counter[0], bound)


def _needs(busy: list[float], rho: float, max_replicas: int) -> list[int]:
    """Pods per bucket: the last minute's work at utilization rho, at least one while there is any."""
    per = WINDOW_S // BUCKET_S
    needs = []
    for b in range(len(busy)):
        work = sum(busy[max(0, b - per + 1):b + 1])
        needs.append(min(max_replicas, max(1 if work else 0, math.ceil(work / (WINDOW_S * rho) - 1e-9))))
    return needs


def _missed_buckets(run: Run, slo: Slo, buckets: int) -> list[int]:
    """The buckets in which requests of a class that misses its target arrived and missed an objective they could
    have met (their prefill alone fits it)."""
    short = {p for p, a in feasible(run, slo)[1].items() if a is not None and a < slo.attainment[p]}
    return sorted({min(buckets - 1, int(r.arrival) // BUCKET_S) for r in run.requests if r.priority in short
                   and r.prefill_s <= slo.ttft_s[r.priority]
                   and (r.first_token is None or r.first_token - r.arrival > slo.ttft_s[r.priority])})
