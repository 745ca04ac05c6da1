"""The autoscaler's recommendation, a pure function: table-driven cases and properties (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, Observation, PodLoad, recommend

POLICY = AutoscalingPolicy(min_replicas=1, max_replicas=10, scale_down_stabilization_s=300)


def obs(t: float, kv: list[float | None], waiting: int = 0, queued: int = 0, current: int | None = None,
        running: int = 1) -> Observation:
    pods = tuple(PodLoad(k, running if k is not None else None, waiting if k is not None else None) for k in kv)
    return Observation(t, len(kv) if current is None else current, pods, queued)


def steady(state: AutoscalerState, policy: AutoscalingPolicy, o: Observation, times: range) -> None:
    """Feed the same load for a while so the burst detector sees it as the stable level."""
    for t in times:
        recommend(Observation(t, o.current_replicas, o.pods, o.gateway_queued), policy, state)


@pytest.mark.parametrize("kv,waiting,queued,expected", [
    ([0.7, 0.7], 0, 0, 2),  # at target
    ([0.75, 0.74], 0, 0, 2),  # within the 0.1 tolerance
    ([0.95, 0.95], 0, 0, 3),  # ceil(2 × 0.95 / 0.7) = 3
    ([0.9, 0.9, 0.9, 0.9], 0, 0, 6),  # ceil(4 × 0.9 / 0.7) = 6
    ([0.3, 0.3], 6, 0, 3),  # queue: 12 waiting / 2 = 6 per replica vs 4 → 3
    ([0.3, 0.3], 0, 20, 4),  # the gateway's queue counts: 20 / 2 = 10 per replica → ×2 cap = 4
])
def test_scale_up_follows_the_larger_signal(kv, waiting, queued, expected) -> None:
    state = AutoscalerState()
    o = obs(1000, kv, waiting, queued)
    assert recommend(o, POLICY, state).desired == expected


def test_scale_up_is_at_most_double_per_step() -> None:
    d = recommend(obs(0, [1.0, 1.0], waiting=40), POLICY, AutoscalerState())
    assert d.desired == 4


@pytest.mark.parametrize(("down_factor", "expected"), [(2.0, 4), (1.25, 7)])
def test_scale_down_waits_for_the_stabilization_window_then_steps_down_at_most_by_its_factor(
        down_factor: float, expected: int) -> None:
    policy = replace(POLICY, max_scale_down_factor=down_factor)
    state = AutoscalerState()
    busy = obs(0, [0.7] * 8)
    assert recommend(busy, policy, state).desired == 8
    idle = [0.05] * 8
    for t in range(15, 300, 15):
        assert recommend(obs(t, idle), policy, state).desired == 8, t  # the busy recommendation is in the window
    d = recommend(obs(315, idle), policy, state)
    assert d.desired == expected and d.reason.startswith("down")  # 8 ÷ 2; or ceil(8 / 1.25)


def test_a_gentle_scale_down_factor_still_removes_a_pod_from_a_small_fleet() -> None:
    policy = replace(POLICY, max_scale_down_factor=1.25, scale_down_stabilization_s=0)
    d = recommend(obs(0, [0.0] * 3), policy, AutoscalerState())
    assert d.desired == 2  # ceil(3 / 1.25) = 3 would never shrink it


@pytest.mark.parametrize(("exponent", "expected"), [(0.5, 6), (1.0, 4)])
def test_scale_down_on_kv_usage_is_damped(exponent: float, expected: int) -> None:
    policy = replace(POLICY, scale_down_stabilization_s=0, kv_scale_down_exponent=exponent)
    d = recommend(obs(0, [0.35] * 8), policy, AutoscalerState())
    assert d.desired == expected  # ratio 0.5: ceil(8 × 0.5 ** 0.5) = 6; HPA's proportional rule: 4


def test_a_burst_lifts_the_double_per_step_cap() -> None:
    policy, state = replace(POLICY, max_replicas=64), AutoscalerState()
    steady(state, policy, obs(0, [0.3, 0.3], running=2), range(0, 60, 15))
    d = recommend(obs(60, [1.0, 1.0], running=60, waiting=40), policy, state)
    assert d.panic and d.desired == 20 and d.reason.startswith("burst")  # (2 × 40) / 4 per replica, not ×2 = 4


@pytest.mark.parametrize("bad", [{"max_scale_up_factor": 1.0}, {"max_scale_down_factor": 2.5},
                                 {"max_scale_down_factor": 1.0}, {"panic_scale_up_factor": 1.5},
                                 {"kv_scale_down_exponent": 0.0}, {"kv_scale_down_exponent": 1.5}])
def test_policy_rejects_scale_factors_that_would_freeze_or_jump(bad: dict) -> None:
    with pytest.raises(ValueError, match="scale factors|exponent"):
        AutoscalingPolicy(**bad)


def test_a_fresh_autoscaler_does_not_scale_down_before_its_window() -> None:
    """An operator restart must not halve an idle-looking fleet at once (HPA seeds its history the same way)."""
    state = AutoscalerState()
    assert recommend(obs(0, [0.05] * 8), POLICY, state).desired == 8
    assert recommend(obs(301, [0.05] * 8), POLICY, state).desired == 4


def test_scale_down_with_no_window_is_immediate() -> None:
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=10, scale_down_stabilization_s=0)
    assert recommend(obs(0, [0.1] * 4), policy, AutoscalerState()).desired == 2


def test_scale_up_stabilization_takes_the_lowest_recent_recommendation() -> None:
    policy = AutoscalingPolicy(max_replicas=10, scale_up_stabilization_s=60, panic_threshold=100)
    state = AutoscalerState()
    assert recommend(obs(0, [0.7, 0.7]), policy, state).desired == 2
    assert recommend(obs(15, [1.0, 1.0]), policy, state).desired == 2  # 2 was recommended within 60 s
    assert recommend(obs(75, [1.0, 1.0]), policy, state).desired == 3


def test_pods_without_metrics_count_as_full_when_scaling_down() -> None:
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=10, scale_down_stabilization_s=0)
    # Two of four pods report 0.3; the two silent ones are taken as at target (0.7): (0.6+1.4)/4 = 0.5 → 3.
    d = recommend(obs(0, [0.3, 0.3, None, None]), policy, AutoscalerState())
    assert d.desired == 3
    # Counted as empty instead, the fleet would have gone to ceil(4 × 0.15 / 0.7) = 1, then ÷2 → 2.


def test_pods_without_metrics_count_as_empty_when_scaling_up() -> None:
    # Two report 1.0, two silent: taken as 0 → average 0.5, below target: no scale-up on guesses.
    d = recommend(obs(0, [1.0, 1.0, None, None]), POLICY, AutoscalerState())
    assert d.desired == 4
    d = recommend(obs(0, [1.0, 1.0, 1.0, 1.0, None]), POLICY, AutoscalerState())
    assert d.desired == 6 and "1 pod(s) without metrics" in d.reason  # (4 + 0) / 5 = 0.8 → ceil(5 × 0.8 / 0.7)


def test_always_within_min_and_max() -> None:
    policy = AutoscalingPolicy(min_replicas=2, max_replicas=3, scale_down_stabilization_s=0)
    assert recommend(obs(0, [1.0, 1.0, 1.0], waiting=50), policy, AutoscalerState()).desired == 3
    d = recommend(obs(0, [0.0, 0.0, 0.0]), policy, AutoscalerState())
    assert d.desired == 2


def test_a_burst_scales_up_at_once_and_blocks_scale_down_for_the_hold() -> None:
    policy = AutoscalingPolicy(max_replicas=20, scale_up_stabilization_s=60, scale_down_stabilization_s=0,
                               stable_window_s=60)
    state = AutoscalerState()
    steady(state, policy, obs(0, [0.7, 0.7], running=2), range(0, 60, 15))
    d = recommend(obs(60, [1.0, 1.0], waiting=10, running=4), policy, state)
    assert d.panic and d.desired == 5 and d.reason.startswith("burst")  # up-window and ×2 cap skipped: 20 / 4
    d = recommend(obs(75, [0.1] * 4, current=4, running=0), policy, state)
    assert d.desired == 4 and "burst hold" in d.reason
    d = recommend(obs(125, [0.1] * 4, current=4, running=0), policy, state)
    assert d.desired == 2  # the hold is over


def test_a_shorter_stable_window_ends_the_bursts_hold_sooner() -> None:
    policy = AutoscalingPolicy(max_replicas=20, scale_down_stabilization_s=0, stable_window_s=10)
    state = AutoscalerState()
    steady(state, policy, obs(0, [0.7, 0.7], running=2), range(0, 20, 2))
    assert recommend(obs(20, [1.0, 1.0], waiting=10, running=4), policy, state).panic
    assert "burst hold" in recommend(obs(25, [0.1] * 4, current=4, running=0), policy, state).reason
    assert recommend(obs(31, [0.1] * 4, current=4, running=0), policy, state).desired < 4  # 60 s by default


def test_a_stable_window_shortened_after_a_burst_ends_the_hold_that_burst_started() -> None:
    policy = AutoscalingPolicy(max_replicas=20, scale_down_stabilization_s=0, stable_window_s=60)
    state = AutoscalerState()
    steady(state, policy, obs(0, [0.7, 0.7], running=2), range(0, 60, 15))
    assert recommend(obs(60, [1.0, 1.0], waiting=10, running=4), policy, state).panic  # a hold until 120
    edited = replace(policy, stable_window_s=6)  # the fleet's spec edited at 70
    assert "burst hold" in recommend(obs(70, [0.1] * 4, current=4, running=0), edited, state).reason
    assert recommend(obs(77, [0.1] * 4, current=4, running=0), edited, state).desired < 4  # not at 120


def test_scale_to_zero_after_the_idle_period_and_back_when_the_gateway_queues() -> None:
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=5, scale_down_stabilization_s=0,
                               scale_to_zero_idle_s=120)
    state = AutoscalerState()
    assert recommend(obs(0, [0.0], running=0), policy, state).desired == 1
    assert recommend(obs(100, [0.0], running=0), policy, state).desired == 1
    d = recommend(obs(130, [0.0], running=0), policy, state)
    assert d.desired == 0 and "idle" in d.reason
    assert recommend(Observation(200, 0, (), 0), policy, state).desired == 0
    d = recommend(Observation(215, 0, (), 9), policy, state)
    assert d.desired == 3 and "scale from zero" in d.reason


def test_min_one_never_scales_to_zero() -> None:
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=5, scale_down_stabilization_s=0)
    state = AutoscalerState()
    for t in range(0, 3600, 60):
        d = recommend(obs(t, [0.0], running=0), policy, state)
    assert d.desired == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"min_replicas": 5, "max_replicas": 2}, "minReplicas"),
    ({"max_replicas": 0, "min_replicas": 0}, "maxReplicas"),
    ({"target_kv_cache_usage": 0}, "targetKVCacheUsage"),
    ({"target_kv_cache_usage": 1.5}, "targetKVCacheUsage"),
    ({"target_queue_per_replica": 0}, "targetQueuePerReplica"),
    ({"tolerance": 1.0}, "tolerance"),
    ({"scale_down_stabilization_s": -1}, "stabilization"),
])
def test_bad_policies_say_what_to_change(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AutoscalingPolicy(**kwargs)


kv_lists = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12)


@given(kv_lists, st.integers(0, 50), st.integers(0, 200), st.integers(0, 4), st.integers(1, 12))
@settings(max_examples=300)
def test_always_within_bounds(kv, waiting, queued, min_r, span) -> None:
    policy = AutoscalingPolicy(min_replicas=min_r, max_replicas=min_r + span)
    d = recommend(obs(0, kv, waiting, queued), policy, AutoscalerState())
    assert policy.min_replicas <= d.desired <= policy.max_replicas or (d.desired == 0 and min_r == 0)


@given(st.integers(1, 10), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 30))
@settings(max_examples=300)
def test_monotone_in_load(n, kv_a, kv_b, waiting) -> None:
    low, high = sorted((kv_a, kv_b))
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=40, scale_down_stabilization_s=0)
    d_low = recommend(obs(0, [low] * n, waiting), policy, AutoscalerState()).desired
    d_high = recommend(obs(0, [high] * n, waiting), policy, AutoscalerState()).desired
    assert d_low <= d_high


@given(st.integers(1, 10), st.floats(0.63, 0.77))  # target 0.7 ± 10 %, the edges included
def test_no_change_within_the_tolerance(n, kv) -> None:
    assert recommend(obs(0, [kv] * n), POLICY, AutoscalerState()).desired == n


@given(st.lists(st.floats(0.45, 0.95), min_size=20, max_size=60), st.integers(2, 8))
@settings(max_examples=100)
def test_noisy_load_does_not_flap(noise, n) -> None:
    """KV usage jittering around its target every 15 s: replicas may rise, but never fall back within the
    300 s scale-down window, so there is no up-down-up flapping."""
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=40, panic_threshold=100)
    state = AutoscalerState()
    current, history = n, []
    for i, kv in enumerate(noise):
        current = recommend(obs(i * 15, [kv] * current), policy, state).desired
        history.append(current)
    downs = [i for i in range(1, len(history)) if history[i] < history[i - 1]]
    ups = [i for i in range(1, len(history)) if history[i] > history[i - 1]]
    for d in downs:
        assert all(d - u >= 300 / 15 for u in ups if u < d)
