"""The SLO-class planner as recommend() runs it: pods from each class's demand in units of work, a standing margin for
the class that cannot wait, a horizon as long as the measured cold start, a safe scale-down, and memory that survives
a trip through the fleet's status."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import SloClass
from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, Observation, PodLoad, recommend
from kvfleet.operator.planner import UTILIZATION, Capacity, PlannerMemory
from tests.support.planner import DECODE, PREFILL, STEADY, WORK_S, classes, observe


def test_steady_demand_plans_the_work_at_the_target_utilization() -> None:
    policy, state = AutoscalingPolicy(max_replicas=64), AutoscalerState()
    for i in range(20):
        decision = recommend(observe(i * 15.0, 4, STEADY), policy, state)
    work = sum(STEADY.values()) * WORK_S
    assert decision.desired == math.ceil(work / UTILIZATION)
    assert decision.plan["workPods"]["standard"] == pytest.approx(2.5 * WORK_S, rel=0.02)
    assert "plan" in decision.reason


def test_with_a_critical_lane_the_plan_has_one_pod_more_while_critical_requests_come() -> None:
    """The gateways keep one engine for critical requests (--critical-lane): the others carry the plan."""
    plain, lane = AutoscalingPolicy(max_replicas=64), AutoscalingPolicy(max_replicas=64, critical_lane=True)
    for rates in (STEADY, {Priority.STANDARD: 2.5}):
        states = AutoscalerState(), AutoscalerState()
        for i in range(20):
            without = recommend(observe(i * 15.0, 4, rates), plain, states[0])
            with_lane = recommend(observe(i * 15.0, 4, rates), lane, states[1])
        extra = 1 if rates.get(Priority.CRITICAL) else 0  # no critical request in the window: no lane to plan
        assert with_lane.desired == without.desired + extra
        assert with_lane.plan["criticalLanePods"] == extra
        assert ("critical lane" in with_lane.reason) == bool(extra)


def test_a_class_with_a_999_target_never_rests_on_one_pod() -> None:
    policy, state = AutoscalingPolicy(max_replicas=8), AutoscalerState()
    for i in range(30):
        decision = recommend(observe(i * 15.0, 2, {Priority.CRITICAL: 0.05}), policy, state)
    assert decision.desired == 2
    relaxed = AutoscalingPolicy(max_replicas=8, slo={Priority.CRITICAL: SloClass(1.0, 0.99),
                                                     Priority.STANDARD: SloClass(2.0, 0.99),
                                                     Priority.SHEDDABLE: SloClass(5.0, 0.0)})
    state = AutoscalerState()
    for i in range(30):
        decision = recommend(observe(i * 15.0, 2, {Priority.CRITICAL: 0.05}), relaxed, state)
    assert decision.desired == 1


def test_after_a_burst_of_critical_work_the_fleet_keeps_a_margin_for_the_next() -> None:
    policy = AutoscalingPolicy(max_replicas=64)
    quiet = {Priority.CRITICAL: 0.3, Priority.STANDARD: 1.0}
    calm, seen = AutoscalerState(), AutoscalerState()
    for i in range(40):
        recommend(observe(i * 15.0, 3, quiet), policy, calm)
        burst = 10 <= i < 14
        recommend(observe(i * 15.0, 3, {Priority.CRITICAL: 3.0, Priority.STANDARD: 10.0} if burst else quiet),
                  policy, seen)
    after_calm = recommend(observe(600.0, 3, quiet), policy, calm).desired
    after_burst = recommend(observe(600.0, 3, quiet), policy, seen).desired
    assert after_burst > after_calm  # the margin for critical (mean + z·σ of its demand) remembers the burst


def test_a_longer_measured_cold_start_plans_further_ahead_on_a_rising_trend() -> None:
    policy = AutoscalingPolicy(max_replicas=64)
    desired = {}
    for cold in (10.0, 120.0):
        state = AutoscalerState()
        for i in range(20):
            rps = {Priority.STANDARD: 0.5 + 0.25 * i}
            d = recommend(observe(i * 15.0, 4, rps, cold_start=cold), policy, state)
        desired[cold] = d.desired
        assert d.plan["horizonSeconds"] == cold + 15
    assert desired[120.0] > desired[10.0]


def test_scale_down_waits_until_the_plan_stayed_below_for_the_window() -> None:
    policy, state = AutoscalingPolicy(max_replicas=64), AutoscalerState()
    high = {Priority.STANDARD: 8.0}
    for i in range(10):
        current = recommend(observe(i * 15.0, 10, high), policy, state).desired
    low = {Priority.STANDARD: 1.0}
    seen = []
    for i in range(10, 20):
        seen.append(recommend(observe(i * 15.0, current, low), policy, state).desired)
    # 60 s (twice the 30 s cold start) of lower plans before the first step down, then down to the plan
    assert seen[:3] == [current] * 3 and seen[-1] < current


def test_waiting_work_is_planned_to_drain_within_the_horizon() -> None:
    policy = AutoscalingPolicy(max_replicas=64)
    without = recommend(observe(0.0, 2, STEADY), policy, AutoscalerState()).desired
    queued = recommend(observe(0.0, 2, STEADY, queued=300), policy, AutoscalerState())
    assert queued.desired >= without + math.floor(300 * WORK_S / 45)
    assert queued.plan["waiting"] == 300


def test_without_measured_capacity_the_queue_and_kv_signals_decide() -> None:
    pods = (PodLoad(0.9, 20, 10),) * 2  # no capacity figures: a vLLM pod, or an engine that has not measured yet
    decision = recommend(Observation(0.0, 2, pods, 0, classes(STEADY), 30.0), AutoscalingPolicy(), AutoscalerState())
    assert decision.plan is None and "KV usage" in decision.reason


def test_a_declared_capacity_plans_a_fleet_whose_pods_do_not_measure_theirs() -> None:
    vllm = (PodLoad(0.2, 3, 0),) * 4  # vLLM's gauges: KV usage, running, waiting; no capacity figures
    policy = AutoscalingPolicy(max_replicas=64, capacity=Capacity(PREFILL, DECODE))
    decision = recommend(Observation(0.0, 4, vllm, 0, classes(STEADY), 30.0), policy, AutoscalerState())
    assert "plan" in decision.reason
    assert decision.plan["workPods"]["standard"] == pytest.approx(2.5 * WORK_S, rel=0.02)
    # a pod that measures itself wins over the declaration: half the declared speed, twice the work per request
    slow = PodLoad(0.2, 3, 0, 64, PREFILL / 2, DECODE / 2)
    measured = recommend(Observation(0.0, 4, (slow,) * 4, 0, classes(STEADY), 30.0), policy, AutoscalerState())
    assert measured.plan["workPods"]["standard"] == pytest.approx(2 * 2.5 * WORK_S, rel=0.02)


def test_capacity_is_learned_as_a_moving_average_and_odd_readings_are_ignored() -> None:
    memory = PlannerMemory()
    memory.learn_capacity(Capacity(500.0, 100.0))
    memory.learn_capacity(Capacity(1000.0, 200.0))
    assert 500 < memory.capacity.prefill_tokens_per_s < 750
    state = AutoscalerState()
    odd = PodLoad(0.3, 20, 0, 64, float("nan"), -5.0)
    recommend(Observation(0.0, 1, (odd,), 0, classes(STEADY), 30.0), AutoscalingPolicy(), state)
    assert state.planner.capacity is None


rates = st.lists(st.tuples(st.floats(0, 6), st.floats(0, 10), st.floats(0, 6), st.integers(0, 200)),
                 min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(rates=rates, cold=st.sampled_from([None, 5.0, 30.0, 300.0]))
def test_planned_decisions_through_the_status_equal_decisions_from_memory(rates, cold) -> None:
    policy = AutoscalingPolicy(max_replicas=64)
    memory, saved, current = AutoscalerState(), AutoscalerState().as_status(), 2
    for i, (c, s, x, q) in enumerate(rates):
        o = observe(1_700_000_000.0 + i * 15.0, current, {Priority.CRITICAL: c, Priority.STANDARD: s,
                                                          Priority.SHEDDABLE: x}, cold, q)
        restarted = AutoscalerState.from_status(json.loads(json.dumps(saved)))
        from_status, from_memory = recommend(o, policy, restarted), recommend(o, policy, memory)
        assert from_status == from_memory, i
        saved, current = restarted.as_status(), from_memory.desired


@pytest.mark.parametrize("planner", [{"capacity": {"prefillTokensPerSecond": "fast"}}, {"demand": [["x", 1]]},
                                     {"demand": [[1.0, 2.0]]}, {"capacity": {"prefillTokensPerSecond": -1,
                                                                             "decodeTokensPerSecond": 3}}, "nope"])
def test_a_hand_edited_planner_status_starts_the_planner_fresh(planner) -> None:
    state = AutoscalerState.from_status({"planner": planner})
    assert state.planner.capacity is None and state.planner.demand == []


def test_the_planners_memory_is_kept_by_the_api_server() -> None:
    """Every key the planner saves is declared in the CRD's status schema (an undeclared one would be pruned, and a
    restarted operator would plan from nothing)."""
    import jsonschema

    from kvfleet.operator.crd import build_crd

    state = AutoscalerState()
    for i in range(5):
        recommend(observe(i * 15.0, 3, STEADY), AutoscalingPolicy(), state)
    saved = json.loads(json.dumps(state.as_status()))
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    jsonschema.validate({"autoscaler": saved}, schema)
    declared = schema["properties"]["autoscaler"]["properties"]["planner"]["properties"]
    assert set(saved["planner"]) == set(declared) == {"capacity", "demand", "forecast"}
    assert set(saved["planner"]["capacity"]) == set(declared["capacity"]["properties"])
    for forecast in saved["planner"]["forecast"].values():
        assert set(forecast) == set(declared["forecast"]["properties"]["critical"]["properties"])


def test_a_bursts_onset_counts_at_once_through_the_short_window() -> None:
    policy = AutoscalingPolicy(max_replicas=64)
    base = {Priority.STANDARD: 1.0}
    burst = classes({Priority.STANDARD: 8.0})
    desired = []
    for recent in (None, burst):
        state = AutoscalerState()
        for i in range(10):
            recommend(observe(i * 15.0, 2, base), policy, state)
        o = observe(150.0, 2, base)
        o = Observation(o.time, o.current_replicas, o.pods, 0, o.classes, 30.0, recent or {})
        desired.append(recommend(o, policy, state).desired)
    assert desired[1] >= desired[0] + math.floor(7.0 * WORK_S)
