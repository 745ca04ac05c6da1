"""The planner's demand forecast (operator/forecast.py): Holt's smoothing follows a level and a ramp, its error is
checked against what came, and its memory survives the status round trip (hostile edits start it fresh)."""

from __future__ import annotations

import json
import math

import pytest

from kvfleet.fleet.priority import Priority
from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, recommend
from kvfleet.operator.forecast import ClassForecast, Holt
from tests.support.planner import STEADY, observe


def test_holt_holds_a_level_and_follows_a_ramp_ahead() -> None:
    flat = Holt()
    for t in range(0, 600, 15):
        flat.update(t, 2.0)
    assert flat.forecast(45) == pytest.approx(2.0)
    ramp = Holt()
    for t in range(0, 1800, 15):
        ramp.update(t, 0.01 * t)  # +0.01 pods of work per second
    assert ramp.forecast(45) == pytest.approx(0.01 * (1785 + 45), rel=0.05)
    fall = Holt()
    for t in range(0, 1800, 15):
        fall.update(t, max(0.0, 5 - 0.01 * t))
    assert fall.forecast(600) == 0.0  # never below zero


def test_each_forecast_is_checked_when_its_time_comes() -> None:
    f = ClassForecast()
    for t in range(0, 300, 15):
        f.step(t, 1.0, 45)
    assert f.error.status() == {"relativeError": 0.0, "underForecast": 0.0, "checked": 17}
    for t in range(300, 360, 15):  # a step up to 3: the forecasts made before it were under
        f.step(t, 3.0, 45)
    status = f.error.status()
    assert status["checked"] == 21 and status["underForecast"] > 0.1 and status["relativeError"] > 0.1


def test_the_forecast_memory_round_trips_exactly_and_hostile_edits_start_fresh() -> None:
    f = ClassForecast()
    for t, v in enumerate([0.3, 0.7, 0.2, 1.9, 0.4]):
        f.step(t * 15.0, v, 45)
    back = ClassForecast.from_status(json.loads(json.dumps(f.as_status())))
    assert back == f
    for hostile in ("x", None, {"trend": "up"}, {**f.as_status(), "pending": [[1]]},
                    {**f.as_status(), "level": math.inf}, {**f.as_status(), "absError": math.nan}):
        assert ClassForecast.from_status(hostile) == ClassForecast()


def test_every_decision_reports_the_forecast_of_each_class_with_a_target() -> None:
    state, decision = AutoscalerState(), None
    for i in range(12):
        decision = recommend(observe(i * 15.0, 3, STEADY), AutoscalingPolicy(), state)
    forecast = decision.plan["forecast"]
    assert set(forecast) == {Priority.CRITICAL.value, Priority.STANDARD.value}  # sheddable: best effort
    assert forecast["standard"]["checked"] == 9 and forecast["standard"]["relativeError"] is not None
    restarted = AutoscalerState.from_status(json.loads(json.dumps(state.as_status())))
    assert restarted.planner.forecasts == state.planner.forecasts


def test_a_gap_between_samples_starts_the_forecast_afresh_rather_than_extrapolating_across_it() -> None:
    f = ClassForecast()
    for t in range(0, 600, 15):
        f.step(t, 0.01 * t, 45)
    assert f.model.forecast(45) > 6.0
    later = f.step(600 + 3600, 4.6, 45)  # an hour without a plan (scaled to zero, or the operator down)
    assert later == 4.6 and f.model.trend == 0.0
    assert f.error.pending == [(600 + 3600 + 45, 4.6)]  # the forecasts made before the gap are not judged by it
