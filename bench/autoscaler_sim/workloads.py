"""Arrival traces for the simulator: a day squeezed into the trace with an idle stretch and sharp bursts (seeded
Poisson arrivals), or an evenly spaced constant load."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvfleet.autoscale_replay.engine_model import MEAN_PROMPT_TOKENS
from kvfleet.autoscale_replay.workloads import bursty_rates, poisson_arrivals

__all__ = ["MEAN_PROMPT_TOKENS", "Trace", "bursty_trace", "constant_trace"]


@dataclass(frozen=True)
class Trace:
    duration_s: int
    rates: tuple[float, ...]  # the intended arrival rate of each second
    arrivals: tuple[tuple[float, int, float], ...]  # (time, prompt tokens, decode work in mean requests), sorted
    bursts: tuple[tuple[int, int, float], ...] = ()  # (start, end, factor)

    def in_burst(self, at: float) -> bool:
        return any(start <= at < end for start, end, _ in self.bursts)


def bursty_trace(seed: int = 0, duration_s: int = 7200, low_rps: float = 1.0, peak_rps: float = 4.0,
                 bursts: int = 5, burst_factor: tuple[float, float] = (5.0, 10.0),
                 burst_s: tuple[int, int] = (30, 120), idle: tuple[int, int] = (1200, 2400)) -> Trace:
    """A day squeezed into the trace (low, peak mid-way, low again), an idle stretch, and sharp bursts that
    multiply the base rate; Poisson arrivals (the package's `bursty` workload draws the same ones)."""
    rng = random.Random(seed)
    rates, placed = bursty_rates(rng, duration_s, low_rps, peak_rps, bursts, burst_factor, burst_s, idle)
    return Trace(duration_s, tuple(rates), tuple(poisson_arrivals(rates, rng)), tuple(placed))


def constant_trace(rate: float, duration_s: int) -> Trace:
    """Evenly spaced mean-sized requests: a load with no randomness at all."""
    count = int(rate * duration_s)
    arrivals = tuple((k / rate, MEAN_PROMPT_TOKENS, 1.0) for k in range(count))
    return Trace(duration_s, (rate,) * duration_s, arrivals)
