"""The bundled workloads of `kvfleet bench autoscale --workload NAME`: seeded generators of the rows a CSV trace
would hold. Arrivals are Poisson at a rate that follows each workload's curve; prompts are uniform 16-256 tokens
and outputs exponential with mean 64 capped at 256 (the engine benchmark's shape); classes are drawn
independently: 20 % critical, 50 % standard, 30 % sheddable (`kvfleet bench`'s example mix)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvfleet.autoscale_replay.engine_model import MEAN_OUTPUT_TOKENS
from kvfleet.autoscale_replay.held_out import HELD_OUT
from kvfleet.autoscale_replay.trace import Row, Trace
from kvfleet.fleet.priority import Priority

PRIORITY_MIX = {Priority.CRITICAL: 0.2, Priority.STANDARD: 0.5, Priority.SHEDDABLE: 0.3}
_EXP_CAP = 4.0  # decode work ~ Exp(1) capped at 4× the mean (the benchmark's outputs: mean 64, capped at 256)


def daily(seed: int = 0, duration_s: int = 7200, low_rps: float = 1.0, peak_rps: float = 4.0) -> Trace:
    """Two hours of a day's curve: 1 req/s, a peak of 4 mid-way, 1 again."""
    return _rows(_day(duration_s, low_rps, peak_rps), seed)


def on_off(seed: int = 0, duration_s: int = 3600, on_s: int = 300, off_s: int = 600, on_rps: float = 6.0,
           off_rps: float = 0.5) -> Trace:
    """An hour of 10 quiet minutes at 0.5 req/s, then 5 on at 6 req/s, and again."""
    return _rows([on_rps if t % (on_s + off_s) >= off_s else off_rps for t in range(duration_s)], seed)


def spike(seed: int = 0, duration_s: int = 1800, base_rps: float = 1.5, factor: float = 10.0,
          spike_s: int = 60) -> Trace:
    """30 minutes at 1.5 req/s with a 10× spike (15 req/s) for 60 s in the middle."""
    start = duration_s // 2
    return _rows([base_rps * (factor if start <= t < start + spike_s else 1) for t in range(duration_s)], seed)


def ramp(seed: int = 0, duration_s: int = 3600, from_rps: float = 0.5, to_rps: float = 6.0) -> Trace:
    """An hour's slow linear ramp from 0.5 to 6 req/s."""
    return _rows([from_rps + (to_rps - from_rps) * t / duration_s for t in range(duration_s)], seed)


def bursty(seed: int = 0, duration_s: int = 7200) -> Trace:
    """bench/autoscaler_sim's 2 hours: the daily curve, 20 idle minutes, five 5-10× bursts of 30-120 s."""
    rng = random.Random(seed)
    rates, _ = bursty_rates(rng, duration_s)
    return _rows(rates, seed, rng)


# the shapes the autoscaler was developed on, and the ones it is judged on (held_out.py)
DEVELOPED: dict[str, Callable[[int], Trace]] = {"daily": daily, "on-off": on_off, "spike": spike, "ramp": ramp,
                                                "bursty": bursty}
WORKLOADS: dict[str, Callable[[int], Trace]] = {**DEVELOPED, **HELD_OUT}


def _day(duration_s: int, low_rps: float, peak_rps: float) -> list[float]:
    return [low_rps + (peak_rps - low_rps) * 0.5 * (1 - math.cos(2 * math.pi * t / duration_s))
            for t in range(duration_s)]


def bursty_rates(rng: random.Random, duration_s: int = 7200, low_rps: float = 1.0, peak_rps: float = 4.0,
                 bursts: int = 5, burst_factor: tuple[float, float] = (5.0, 10.0),
                 burst_s: tuple[int, int] = (30, 120),
                 idle: tuple[int, int] = (1200, 2400)) -> tuple[list[float], list[tuple[int, int, float]]]:
    """The bursty trace's rate per second and its bursts (start, end, factor): a daily curve, an idle stretch, and
    sharp bursts that multiply the base rate, placed apart from each other and from the idle stretch."""
    rates = _day(duration_s, low_rps, peak_rps)
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
    return rates, sorted(placed)


def poisson_arrivals(rates: list[float], rng: random.Random) -> list[tuple[float, int, float]]:
    """(time, prompt tokens, decode work in mean requests) of Poisson arrivals at each second's rate."""
    arrivals = []
    for second, rate in enumerate(rates):
        at = second + (rng.expovariate(rate) if rate > 0 else 1.0)
        while at < second + 1:
            work = min(rng.expovariate(1.0), _EXP_CAP) / (1 - math.exp(-_EXP_CAP))
            arrivals.append((at, rng.randint(16, 256), work))
            at += rng.expovariate(rate)
    return arrivals


def _rows(rates: list[float], seed: int, rng: random.Random | None = None) -> Trace:
    """Poisson rows at the rates; classes come from their own generator, so the arrivals match bench's traces."""
    classes = random.Random(f"priority-{seed}")
    names, weights = list(PRIORITY_MIX), list(PRIORITY_MIX.values())
    rows = [Row(at, prompt, max(1, round(work * MEAN_OUTPUT_TOKENS)), classes.choices(names, weights)[0])
            for at, prompt, work in poisson_arrivals(rates, rng or random.Random(seed))]
    return Trace.of(rows)  # ends with its last request, as the same rows read from CSV do
