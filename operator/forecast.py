"""Short-horizon demand forecasts per class for the planner (pure), and the error each one turns out to have.

Holt's linear exponential smoothing (level and trend, each smoothed; Holt 1957, as statsmodels' Holt and Dynamo's
planner's simplest forecaster): cheap, stateless across restarts but for four numbers, and measured on the held-out
traces against the least-squares trend it replaces and statsmodels' fitted Holt (bench/forecast_demand.py).

A forecast made at t for t + h is checked when a sample at or after t + h arrives: the absolute error and the demand
it missed are kept as moving sums, so status can say how far off the forecasts have been (relative error = mean
absolute error / mean demand; under = the share of forecasts below 0.8 × what came).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_GAP_S = 120.0  # a longer gap between samples (no plan: at zero, no counts, the operator down) starts afresh
PENDING = 512  # forecasts awaiting their check (a horizon of up to 512 periods)
ALPHA = 0.5  # weight of a new sample in the level (tuned on the bundled workloads' seeds 0-9, never held-out ones)
BETA = 0.05  # weight of a new slope in the trend
ERROR_DECAY = 0.05  # weight of a new error in the moving sums (about the last 20 checks)
UNDER = 0.8  # a forecast below this share of what came is an under-forecast


@dataclass
class Holt:
    """Level and trend (per second) of one series sampled at irregular times."""

    level: float | None = None
    trend: float = 0.0
    t: float | None = None

    def update(self, t: float, value: float) -> None:
        if self.level is None or self.t is None or t <= self.t or t - self.t > MAX_GAP_S:
            self.level, self.trend, self.t = value, 0.0, t  # a trend is not carried across a gap
            return
        dt = t - self.t
        predicted = self.level + self.trend * dt
        level = ALPHA * value + (1 - ALPHA) * predicted
        self.trend = BETA * (level - self.level) / dt + (1 - BETA) * self.trend
        self.level, self.t = level, t

    def forecast(self, horizon_s: float) -> float:
        """The demand expected horizon_s after the last sample (never below 0)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * horizon_s)


@dataclass
class ForecastError:
    """How far the forecasts came from what followed: moving sums of |error|, demand, and under-forecasts."""

    pending: list[tuple[float, float]] = field(default_factory=list)  # (due time, forecast)
    abs_error: float = 0.0
    demand: float = 0.0
    under: float = 0.0
    checked: int = 0

    def expect(self, due: float, forecast: float) -> None:
        self.pending.append((due, forecast))
        del self.pending[:-PENDING]  # bounded: a stopped clock cannot grow it

    def observe(self, t: float, actual: float) -> None:
        """A sample at t checks every forecast due by then."""
        due = [f for d, f in self.pending if d <= t]
        self.pending = [(d, f) for d, f in self.pending if d > t]
        for forecast in due:
            w = ERROR_DECAY if self.checked else 1.0
            self.abs_error += w * (abs(forecast - actual) - self.abs_error)
            self.demand += w * (actual - self.demand)
            self.under += w * (float(forecast < UNDER * actual) - self.under)
            self.checked += 1

    def status(self) -> dict:
        relative = self.abs_error / self.demand if self.demand > 0 else None
        return {"relativeError": None if relative is None else round(relative, 3),
                "underForecast": round(self.under, 3), "checked": self.checked}


@dataclass
class ClassForecast:
    """One class's forecaster and its error record."""

    model: Holt = field(default_factory=Holt)
    error: ForecastError = field(default_factory=ForecastError)

    def step(self, t: float, value: float, horizon_s: float) -> float:
        """Take the sample at t, check the forecasts due, and forecast horizon_s ahead (recorded to be checked).
        After a gap the forecasts still waiting are dropped: what they foresaw was not observed."""
        if self.model.t is not None and t - self.model.t > MAX_GAP_S:
            self.error.pending.clear()
        self.error.observe(t, value)
        self.model.update(t, value)
        out = self.model.forecast(horizon_s)
        self.error.expect(t + horizon_s, out)
        return out

    def as_status(self) -> dict:
        """Its memory, unrounded (a restarted operator forecasts exactly as this one would); STATUS_SCHEMA's keys."""
        e, m = self.error, self.model
        # level and time written even when None: the status is merge-patched, and an absent key would keep an old one
        return {"level": m.level, "time": m.t, "trend": m.trend, "absError": e.abs_error, "demand": e.demand,
                "under": e.under, "checked": e.checked, "pending": [list(p) for p in e.pending]}

    @classmethod
    def from_status(cls, saved: object) -> ClassForecast:
        """The memory as_status saved; a fresh one where it was edited into something else."""
        try:
            level, t = saved.get("level"), saved.get("time")  # type: ignore[union-attr]
            out = cls(Holt(None if level is None or t is None else float(level), float(saved["trend"]),
                           None if level is None or t is None else float(t)),
                      ForecastError([(float(d), float(f)) for d, f in saved["pending"]][-PENDING:],
                                    float(saved["absError"]), float(saved["demand"]), float(saved["under"]),
                                    int(saved["checked"])))
        except (TypeError, ValueError, KeyError, AttributeError):
            return cls()
        numbers = [out.model.trend, out.error.abs_error, out.error.demand, out.error.under]
        if not all(math.isfinite(x) for x in numbers) or (out.model.level is not None
                                                          and not math.isfinite(out.model.level)):
            return cls()
        return out


STATUS_SCHEMA = {"type": "object", "properties": {
    **{k: {"type": "number", "nullable": True} for k in ("level", "time")},
    **{k: {"type": "number"} for k in ("trend", "absError", "demand", "under")},
    "checked": {"type": "integer"},
    "pending": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}}


def forecasts_status(forecasts: Mapping[str, ClassForecast], latest: Mapping[str, float], horizon_s: float) -> dict:
    """status.autoscaler.forecast: per class, the latest forecast (pods of work horizon_s ahead) and its error."""
    return {name: {"workPods": round(latest.get(name, 0.0), 3), "horizonSeconds": round(horizon_s, 1),
                   **f.error.status()} for name, f in forecasts.items()}
