"""The autoscaler's state survives a trip through the fleet's status (JSON) between any two periods: the
decisions are the ones an operator that never restarted would make."""

from __future__ import annotations

import json

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, Observation, PodLoad, recommend
from kvfleet.operator.crd import build_crd

loads = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 12), st.integers(0, 30)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(loads=loads, down_s=st.sampled_from([0, 30, 60, 300]), up_s=st.sampled_from([0, 30]),
       min_replicas=st.integers(0, 2), period_s=st.sampled_from([1, 15]))
def test_decisions_through_the_status_equal_decisions_from_memory(loads, down_s, up_s, min_replicas,
                                                                  period_s) -> None:
    policy = AutoscalingPolicy(min_replicas=min_replicas, max_replicas=12, scale_down_stabilization_s=down_s,
                               scale_up_stabilization_s=up_s, scale_to_zero_idle_s=45)
    memory, saved = AutoscalerState(), AutoscalerState().as_status()
    current = 2
    for i, (kv, waiting, queued) in enumerate(loads):
        pods = tuple(PodLoad(kv, 1, waiting) for _ in range(current))
        o = Observation(1_700_000_000.0 + i * period_s, current, pods, queued)
        restarted = AutoscalerState.from_status(json.loads(json.dumps(saved)))
        from_status, from_memory = recommend(o, policy, restarted), recommend(o, policy, memory)
        assert from_status == from_memory, i
        saved, current = restarted.as_status(), from_memory.desired


def test_the_status_form_keeps_one_entry_per_run_of_equal_recommendations() -> None:
    state = AutoscalerState(recommendations=[(0.0, 3), (15.0, 3), (30.0, 2), (45.0, 2), (60.0, 3)],
                            loads=[(60.0, 4.0)], last_busy=60.0)
    saved = json.loads(json.dumps(state.as_status()))
    status_schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    jsonschema.validate({"autoscaler": saved}, status_schema)  # what the API server will accept
    assert saved["recommendations"] == [[15.0, 3], [45.0, 2], [60.0, 3]]
    assert AutoscalerState.from_status(saved).last_busy == 60.0 and "panicUntil" not in saved


def test_a_missing_or_hand_edited_status_starts_fresh() -> None:
    assert AutoscalerState.from_status(None) == AutoscalerState()
    assert AutoscalerState.from_status({"recommendations": [["soon", 3]]}) == AutoscalerState()
