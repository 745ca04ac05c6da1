"""Batch work in the autoscaler: a backlog with a deadline is demand only when the capacity interactive traffic
leaves cannot finish it in time (counting the cold start); a backlog without urgency never holds replicas up, nor
keeps an idle fleet from scaling to zero; at zero pods a batch starts one once its window needs it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvfleet.fleet.priority import Priority
from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, PodLoad, recommend
from kvfleet.operator.batch_demand import SAFETY, BatchBacklog, batch_pods, parse_backlog
from kvfleet.operator.planner import Capacity
from tests.support.planner import DECODE, PREFILL, STEADY, observe

CAPACITY = Capacity(PREFILL, DECODE)
BATCH_WORK_S = CAPACITY.work_s(200, 100)  # pod-seconds of one batch request below


def backlog(remaining: int, deadline: float) -> BatchBacklog:
    return BatchBacklog(remaining, 200.0, 100.0, deadline)


def test_a_backlog_that_fits_in_the_leftover_capacity_adds_nothing() -> None:
    extra, why = batch_pods([backlog(1000, 3600.0)], CAPACITY, 0.0, 45.0, leftover_pods=2.0)
    assert extra == 0 and "on time" in why


def test_a_backlog_at_risk_adds_the_pods_to_finish_it_by_its_deadline() -> None:
    need = 1000 * BATCH_WORK_S * SAFETY / (600.0 - 45.0)
    extra, why = batch_pods([backlog(1000, 600.0)], CAPACITY, 0.0, 45.0, leftover_pods=0.5)
    assert extra == pytest.approx(need - 0.5) and "at risk" in why


def test_batches_are_planned_earliest_deadline_first() -> None:
    late, soon = backlog(100, 10_000.0), backlog(100, 300.0)
    extra, _ = batch_pods([late, soon], CAPACITY, 0.0, 0.0, 0.0)
    assert extra == pytest.approx(max(100 * BATCH_WORK_S * SAFETY / 300.0, 200 * BATCH_WORK_S * SAFETY / 10_000.0))


def test_at_zero_pods_a_batch_waits_until_its_window_needs_a_pod() -> None:
    assert batch_pods([backlog(50, 86_400.0)], CAPACITY, 0.0, 45.0, 0.0)[0] == 0.0  # a day: it can wait
    assert batch_pods([backlog(50, 86_400.0)], CAPACITY, 86_000.0, 45.0, 0.0)[0] == 0.0  # one pod still has time
    assert batch_pods([backlog(50, 86_400.0)], CAPACITY, 86_300.0, 45.0, 0.0)[0] > 0  # now it must start


def test_the_gateways_reports_are_read_and_bad_or_stale_ones_skipped() -> None:
    good = {"remaining": 5, "prompt_tokens": 10, "output_tokens": 20, "deadline": 900, "reported_at": 100}
    values = [json.dumps(good), "not json", json.dumps({**good, "remaining": "many"}),
              json.dumps({**good, "reported_at": 10}), json.dumps({**good, "prompt_tokens": "nan"}),
              json.dumps({**good, "remaining": 0}), "[" * 5000]
    assert parse_backlog(values, now=110.0) == [BatchBacklog(5, 10.0, 20.0, 900.0)]


def with_batch(obs, items):
    return dataclasses.replace(obs, batch=tuple(items))


def test_an_urgent_backlog_raises_the_fleet_and_a_relaxed_one_does_not() -> None:
    policy = AutoscalingPolicy(max_replicas=64)
    base = recommend(observe(0.0, 4, STEADY), policy, AutoscalerState())
    relaxed = recommend(with_batch(observe(0.0, 4, STEADY), [backlog(200, 86_400.0)]), policy, AutoscalerState())
    assert relaxed.desired == base.desired and relaxed.plan["batchPods"] == 0
    urgent = recommend(with_batch(observe(0.0, 4, STEADY), [backlog(20_000, 900.0)]), policy, AutoscalerState())
    assert urgent.desired > base.desired and "batch backlog at risk" in urgent.reason
    needed = 20_000 * BATCH_WORK_S * SAFETY / (900.0 - 30.0 - 15.0)
    assert urgent.desired >= math.ceil(needed)


def test_an_idle_fleet_with_a_relaxed_backlog_still_scales_to_zero_and_an_urgent_one_starts_it() -> None:
    policy = AutoscalingPolicy(min_replicas=0, scale_to_zero_idle_s=60, capacity=CAPACITY)
    state = AutoscalerState()
    idle = {p: 0.0 for p in Priority}
    quiet = PodLoad(0.0, 0, 0, 64, PREFILL, DECODE)
    decision = None
    for i in range(40):
        obs = dataclasses.replace(observe(i * 15.0, 1, idle), pods=(quiet,))
        decision = recommend(with_batch(obs, [backlog(10, 86_400.0)]), policy, state)
    assert decision.desired == 0 and "scale to zero" in decision.reason
    from_zero = recommend(with_batch(observe(200.0, 0, idle), [backlog(10, 86_400.0)]), policy, AutoscalerState())
    assert from_zero.desired == 0
    urgent = recommend(with_batch(observe(200.0, 0, idle), [backlog(5_000, 1_200.0)]), policy, AutoscalerState())
    assert urgent.desired >= 1 and "scale from zero" in urgent.reason
