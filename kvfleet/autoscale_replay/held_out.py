"""Held-out traces for judging an autoscaling policy on traffic it was not tuned on (`kvfleet bench autoscale
--workload NAME --seed S`): shapes unlike the bundled ones the policy was developed on, and a class mix and prompt
lengths of their own. Each is seeded; the seeds the policy is developed on are never the ones it is judged on.

Every trace: 10 % critical, 60 % standard, 30 % sheddable; prompts log-normal (median 120 tokens, a long tail cut at
2,048: some critical prompts then take longer to prefill than the 1 s objective, and no policy can serve those in
time, which the report tells apart), outputs exponential with mean 64 capped at 256. But azure-conv: an hour shaped
by a public production trace's published statistics (azure_conv_2023.json: Azure's LLM inference trace of 2023,
conversation service), its arrivals per 10 s thinned to this fleet's scale and its token percentiles scaled down.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path

from kvfleet.autoscale_replay.engine_model import MEAN_OUTPUT_TOKENS
from kvfleet.autoscale_replay.trace import Row, Trace
from kvfleet.fleet.priority import Priority

MIX = {Priority.CRITICAL: 0.1, Priority.STANDARD: 0.6, Priority.SHEDDABLE: 0.3}
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MAX = 120, 0.9, 2048
_EXP_CAP = 4.0


def hump(duration_s: int, base_rps: float, peak_rps: float) -> list[float]:
    """A slow hump: base, up to peak mid-way, back to base (a day compressed into the trace)."""
    return [base_rps + (peak_rps - base_rps) * 0.5 * (1 - math.cos(2 * math.pi * t / duration_s))
            for t in range(duration_s)]


def with_bursts(rates: list[float], rng: random.Random, count: int, height: float, length_s: int) -> list[float]:
    """The rates with `count` bursts of `height` × the rate there for `length_s` each, apart from each other."""
    out = list(rates)
    taken: list[tuple[int, int]] = []
    for _ in range(count):
        for _attempt in range(1000):
            start = rng.randrange(120, len(out) - length_s - 120)
            if all(start + length_s + 300 < a or start > b + 300 for a, b in taken):
                break
        else:
            raise ValueError(f"no room for {count} bursts of {length_s} s in {len(out)} s")
        taken.append((start, start + length_s))
        for t in range(start, start + length_s):
            out[t] *= height
    return out


def bursts(seed: int, height: float = 6.0, length_s: int = 90, count: int = 3, duration_s: int = 3600,
           base_rps: float = 1.0, peak_rps: float = 2.5) -> Trace:
    """Held out: an hour's hump (1 to 2.5 req/s) with three bursts of 6× for 90 s."""
    rng = random.Random(f"bursts-{seed}")
    return rows(with_bursts(hump(duration_s, base_rps, peak_rps), rng, count, height, length_s), seed)


def flash_crowd(seed: int, factor: float = 10.0, duration_s: int = 3600, base_rps: float = 1.0,
                hold_s: int = 300, decay_s: int = 600) -> Trace:
    """Held out: an hour at 1 req/s hit by a 10× flash crowd (held 5 minutes, fading over 10)."""
    rng = random.Random(f"flash-{seed}")
    start = rng.randrange(600, duration_s - hold_s - decay_s - 300)
    rates = []
    for t in range(duration_s):
        if start <= t < start + hold_s:
            level = factor
        elif start + hold_s <= t < start + hold_s + decay_s:
            level = factor - (factor - 1) * (t - start - hold_s) / decay_s
        else:
            level = 1.0
        rates.append(base_rps * level)
    return rows(rates, seed)


def daily(seed: int, duration_s: int = 7200, base_rps: float = 0.5, peak_rps: float = 4.0) -> Trace:
    """Held out: two hours of a day's cycle, 0.5 to 4 req/s and back, each minute's rate ±30 % around it."""
    rng = random.Random(f"daily-{seed}")
    curve = hump(duration_s, base_rps, peak_rps)
    noise = [rng.uniform(0.7, 1.3) for _ in range(duration_s // 60 + 1)]
    return rows([rate * noise[t // 60] for t, rate in enumerate(curve)], seed)


def short_bursts(seed: int) -> Trace:
    """Held out: an hour's hump (1 to 2.5 req/s) with five bursts of 4× for 30 s."""
    return bursts(seed, height=4.0, length_s=30, count=5)


def long_bursts(seed: int) -> Trace:
    """Held out: an hour's hump (1 to 2.5 req/s) with two bursts of 3× for 5 minutes."""
    return bursts(seed, height=3.0, length_s=300, count=2)


AZURE_CONV = Path(__file__).with_name("azure_conv_2023.json")
AZURE_RATE_SCALE = 0.3  # its 5.5 req/s on a large fleet -> 1.7 req/s here, as the other held-out traces' scale
AZURE_PROMPT_SCALE = 0.12  # its median context of 1,020 tokens -> 122 (this CPU prefills 480 tokens/s)
AZURE_OUTPUT_SCALE = 0.3  # its mean output of 211 tokens -> 63


@cache
def azure_conv_statistics() -> dict:
    return json.loads(AZURE_CONV.read_text())


def azure_conv(seed: int) -> Trace:
    """Held out: an hour shaped by Azure's 2023 conversation trace (its arrivals per 10 s, 2.7x from its quietest
    minute to its busiest; its prompt and output percentiles), thinned to ~1.7 req/s and tokens scaled down."""
    stats = azure_conv_statistics()
    step = stats["step_s"]
    rates = [n / step * AZURE_RATE_SCALE for n in stats["arrivals_per_step"] for _ in range(step)]
    rng = random.Random(f"azure-conv-{seed}")
    prompts, outputs = stats["context_tokens_percentiles"], stats["generated_tokens_percentiles"]

    def tokens() -> tuple[int, int]:
        prompt = min(PROMPT_MAX, max(1, round(percentile(prompts, rng.random()) * AZURE_PROMPT_SCALE)))
        return prompt, max(1, round(percentile(outputs, rng.random()) * AZURE_OUTPUT_SCALE))
    return rows(rates, seed, tokens)


def percentile(points: list[int], u: float) -> float:
    """The value at quantile u of a distribution given by its 101 percentiles (linear between them)."""
    x = u * (len(points) - 1)
    k = min(int(x), len(points) - 2)
    return points[k] + (points[k + 1] - points[k]) * (x - k)


HELD_OUT = {"bursts-6x90": bursts, "bursts-4x30": short_bursts, "bursts-3x300": long_bursts,
            "flash-10x": flash_crowd, "daily-noisy": daily, "azure-conv": azure_conv}


def rows(rates: list[float], seed: int, tokens: Callable[[], tuple[int, int]] | None = None) -> Trace:
    """Poisson arrivals at each second's rate, classes by MIX; log-normal prompts and exponential outputs, unless
    `tokens` draws each request's (prompt, output) tokens."""
    rng = random.Random(f"arrivals-{seed}")
    names, weights = list(MIX), list(MIX.values())
    out = []
    for second, rate in enumerate(rates):
        at = second + (rng.expovariate(rate) if rate > 0 else 1.0)
        while at < second + 1:
            if tokens is not None:
                prompt, output = tokens()
            else:
                prompt = min(PROMPT_MAX, max(1, round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))))
                work = min(rng.expovariate(1.0), _EXP_CAP) / (1 - math.exp(-_EXP_CAP))
                output = max(1, round(work * MEAN_OUTPUT_TOKENS))
            out.append(Row(at, prompt, output, rng.choices(names, weights)[0]))
            at += rng.expovariate(rate)
    return Trace.of(out)
