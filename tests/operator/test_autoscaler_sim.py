"""The autoscaling simulator's own parts (bench/autoscaler_sim/): steady load, conservation, calibration,
determinism. Fast: seconds of pure Python, no processes."""

from __future__ import annotations

import pytest

from bench.autoscaler_sim import (
    EngineModel,
    FleetView,
    KvfleetPolicy,
    bursty_trace,
    constant_trace,
    queue_length_hpa,
    request_rate_hpa,
    simulate,
)
from kvfleet.operator.autoscaler import AutoscalingPolicy


class Hold:
    """Keeps whatever replica count it is given."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def desired(self, view: FleetView) -> int:
        return self.replicas


@pytest.mark.parametrize("make,rate,start", [
    (lambda: Hold(3), 2.5, 3),
    (lambda: request_rate_hpa(max_replicas=16, per_replica=0.84), 3.2, 4),  # 3.2 / 0.84 = 3.8: within tolerance of 4
    (lambda: KvfleetPolicy(AutoscalingPolicy(min_replicas=1, max_replicas=16)), 0.8, 1),
])
def test_constant_load_keeps_replicas_steady_and_within_the_slo(make, rate, start) -> None:
    result = simulate(constant_trace(rate, 1800), make(), initial_replicas=start)
    assert set(result.replicas) == {start}
    summary = result.summary()
    assert summary["slo_attainment"] == 1.0 and summary["ttft_p99_s"] < 1.0
    assert summary["replica_seconds"] == start * 1800


@pytest.mark.parametrize("make", [
    lambda: Hold(2),
    lambda: KvfleetPolicy(AutoscalingPolicy(min_replicas=0, max_replicas=6)),
    lambda: queue_length_hpa(max_replicas=6),
])
def test_every_request_is_served_or_still_waiting_at_the_end(make) -> None:
    trace = bursty_trace(seed=3, duration_s=1500, bursts=2, idle=(300, 500))
    result = simulate(trace, make(), tail_s=0)  # stop with the trace: a backlog is left
    assert result.completed + result.in_pods + result.gateway_queued == len(trace.arrivals)
    assert result.in_pods + result.gateway_queued > 0
    assert all(t >= 0 for t in result.ttfts)


def test_a_pod_kept_full_serves_its_calibrated_capacity() -> None:
    engine = EngineModel()
    result = simulate(constant_trace(3.0, 1200), Hold(1), engine, tail_s=0)
    assert result.completed / 1200 == pytest.approx(engine.capacity_rps, rel=0.05)


def test_no_first_token_before_the_first_pod_is_ready() -> None:
    trace = constant_trace(2.0, 60)
    result = simulate(trace, Hold(1), EngineModel(cold_start_s=30), initial_replicas=0, tail_s=0)
    first_tokens = [at + ttft for (at, _, _), ttft in zip(trace.arrivals, result.ttfts, strict=True)]
    assert min(first_tokens) >= 30.0
    assert result.ttfts[0] >= 30.0  # the first request waited in the gateway's queue for the cold start


def test_same_seed_same_run_other_seed_other_trace() -> None:
    def run(seed: int) -> dict:
        return simulate(bursty_trace(seed=seed, duration_s=600, bursts=1, idle=(100, 200)),
                        KvfleetPolicy(AutoscalingPolicy(max_replicas=16))).summary()

    assert bursty_trace(seed=5) == bursty_trace(seed=5)
    assert bursty_trace(seed=5).arrivals != bursty_trace(seed=6).arrivals
    assert run(5) == run(5)
