"""Arrival traces for the simulator: a day squeezed into the trace with an idle stretch and sharp bursts (seeded
Poisson arrivals), or an evenly spaced constant load."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MEAN_PROMPT_TOKENS = 136  # uniform 16-256, the engine benchmark's prompts
_EXP_CAP = 4.0  # decode work ~ Exp(1) capped at 4× the mean (the benchmark's outputs: mean 64, capped at 256)


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
    multiply the base rate; Poisson arrivals."""
    rng = random.Random(seed)
    rates = [low_rps + (peak_rps - low_rps) * 0.5 * (1 - math.cos(2 * math.pi * t / duration_s))
             for t in range(duration_s)]
    for t in range(*idle):
        rates[t] = 0.0
    taken, placed = [(idle[0] - 60, idle[1] + 60)], []
    for _ in range(bursts):
        for _attempt in range(1000):
            length = rng.randint(*burst_s)
            start = rng.randrange(60, duration_s - length - 60)
            if all(start + length + 180 < a or start > b + 180 for a, b in taken):
                break
        else:
            raise ValueError(f"no room for {bursts} bursts of up to {burst_s[1]} s in {duration_s} s")
        taken.append((start, start + length))
        factor = rng.uniform(*burst_factor)
        placed.append((start, start + length, factor))
        for t in range(start, start + length):
            rates[t] *= factor
    return Trace(duration_s, tuple(rates), _poisson(rates, rng), tuple(sorted(placed)))


def constant_trace(rate: float, duration_s: int) -> Trace:
    """Evenly spaced mean-sized requests: a load with no randomness at all."""
    count = int(rate * duration_s)
    arrivals = tuple((k / rate, MEAN_PROMPT_TOKENS, 1.0) for k in range(count))
    return Trace(duration_s, (rate,) * duration_s, arrivals)


def _poisson(rates: list[float], rng: random.Random) -> tuple[tuple[float, int, float], ...]:
    arrivals = []
    for second, rate in enumerate(rates):
        at = second + (rng.expovariate(rate) if rate > 0 else 1.0)
        while at < second + 1:
            work = min(rng.expovariate(1.0), _EXP_CAP) / (1 - math.exp(-_EXP_CAP))
            arrivals.append((at, rng.randint(16, 256), work))
            at += rng.expovariate(rate)
    return tuple(arrivals)
