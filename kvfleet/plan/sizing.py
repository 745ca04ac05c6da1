"""The sizing rules, pure: maxModelLen from the P99 prompt plus the output allowed (rounded up to whole blocks), a
batch where the engine's measured decode curve flattens, KV memory for that batch at the traffic's P95 context (and
never less than one maxModelLen sequence, which the engine requires), and the fewest replicas that meet every class's
TTFT objective at 150 % of the target rate (the post-mortem's load-test rule), found by replaying a synthetic trace
drawn from the log through the replay's engine model with a fixed fleet."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from kvfleet.autoscale_replay.engine_model import EngineModel
from kvfleet.autoscale_replay.fleet import simulate
from kvfleet.autoscale_replay.replay import requests_of
from kvfleet.autoscale_replay.slo import Slo, attainment
from kvfleet.autoscale_replay.trace import Row, Trace
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.config import DEFAULT_CAPS

LOAD_TEST_FACTOR = 1.5  # size for 150 % of the target rate
DECODE_SHARE = 0.8  # the batch where decode throughput reaches this share of its asymptote
KV_HEADROOM = 1.1  # above the batch's P95 contexts: a few longer ones at once do not preempt
SIM_SECONDS = 600
MAX_SIM_REQUESTS = 200_000  # a faster rate replays fewer seconds: the replay stays seconds long, whatever the log
MAX_BATCH = 4096  # the InferenceFleet's bound on maxNumSeqs
RATE_WINDOW_S = 60
KV_WASTE_TARGET = 0.04  # slots allocated but empty, as vLLM reports it (under 4 %)
BLOCK_CANDIDATES = (32, 16, 8)  # largest first: larger blocks mean shorter block tables and cheaper kernels


@dataclass(frozen=True)
class Traffic:
    """What a log says about its requests."""

    requests: int
    duration_s: int
    mean_qps: float
    peak_qps: float  # the busiest RATE_WINDOW_S
    prompt_p50: int
    prompt_p99: int
    output_p50: int
    output_p99: int
    context_p95: int  # prompt + output
    shares: dict[Priority, float]


@dataclass(frozen=True)
class Plan:
    max_model_len: int
    block_size: int
    max_num_seqs: int
    kv_tokens: int
    kv_bytes: int
    replicas: int | None  # None: not met within max_replicas
    target_qps: float
    attainment: dict[Priority, float | None]
    reasons: tuple[str, ...]


def percentile(values: list[int], q: float) -> int:
    """The nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def describe(trace: Trace) -> Traffic:
    rows = trace.rows
    prompts, outputs = [r.prompt_tokens for r in rows], [r.output_tokens for r in rows]
    duration = max(1, trace.duration_s)
    windows: dict[int, int] = {}
    for r in rows:
        windows[int(r.t // RATE_WINDOW_S)] = windows.get(int(r.t // RATE_WINDOW_S), 0) + 1
    peak = max(windows.values()) / min(RATE_WINDOW_S, duration)
    return Traffic(len(rows), duration, len(rows) / duration, peak, percentile(prompts, 50), percentile(prompts, 99),
                   percentile(outputs, 50), percentile(outputs, 99),
                   percentile([p + o for p, o in zip(prompts, outputs, strict=True)], 95),
                   {p: trace.count(p) / len(rows) for p in Priority})


def round_up(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


def kv_waste(contexts: list[int], block_size: int) -> float:
    """The share of the KV slots sequences of these lengths hold that no token fills (each one's last block)."""
    allocated = sum(round_up(c, block_size) for c in contexts)
    return (allocated - sum(contexts)) / allocated if allocated else 0.0


def block_size_for(trace: Trace, target: float = KV_WASTE_TARGET) -> tuple[int, float]:
    """The largest block size whose waste stays within `target` for this traffic's sequences halfway through their
    output (a batch's typical moment), and that waste; the smallest candidate where none does."""
    contexts = [r.prompt_tokens + r.output_tokens // 2 for r in trace.rows]
    for block_size in BLOCK_CANDIDATES:
        waste = kv_waste(contexts, block_size)
        if waste <= target:
            return block_size, waste
    return BLOCK_CANDIDATES[-1], kv_waste(contexts, BLOCK_CANDIDATES[-1])


def with_batch(engine: EngineModel, max_num_seqs: int) -> EngineModel:
    """The same engine run at another batch: its decode curve (half its asymptote at half_rate_batch) moved along."""
    full = engine.capacity_rps / (1 - engine.capacity_rps * engine.mean_prefill_s)  # decode-only, at its batch
    asymptote = full * (engine.max_num_seqs + engine.half_rate_batch) / engine.max_num_seqs
    full_new = asymptote * max_num_seqs / (max_num_seqs + engine.half_rate_batch)
    return replace(engine, max_num_seqs=max_num_seqs, capacity_rps=full_new / (1 + full_new * engine.mean_prefill_s))


def batch_for(engine: EngineModel, share: float = DECODE_SHARE) -> int:
    """The smallest batch (a multiple of 8) whose decode throughput is `share` of the asymptote: n / (n + h)."""
    n = share * engine.half_rate_batch / (1 - share)
    return min(MAX_BATCH, max(8, round_up(math.ceil(n), 8)))


def synthetic(trace: Trace, qps: float, seconds: int, seed: int = 0) -> Trace:
    """Poisson arrivals at qps, each a request drawn from the log (sizes and class together)."""
    rng, rows, t = random.Random(seed), [], 0.0
    while (t := t + rng.expovariate(qps)) < seconds:
        r = rng.choice(trace.rows)
        rows.append(Row(t, r.prompt_tokens, r.output_tokens, r.priority))
    return Trace.of(rows)


class _Fixed:
    def __init__(self, n: int) -> None:
        self.n = n

    def desired(self, view: object) -> int:
        return self.n


def unreachable(load: Trace, engine: EngineModel, slo: Slo) -> dict[Priority, float]:
    """Classes whose objective no number of pods meets: the prefill alone of more than (1 - target) of their
    requests takes longer than the objective. Maps each to that prefill time at the target's quantile."""
    out = {}
    for p in Priority:
        prompts = [r.prompt_tokens for r in load.rows if r.priority is p]
        if prompts and slo.attainment[p] > 0:
            prefill = percentile(prompts, 100 * slo.attainment[p]) / engine.prefill_tokens_per_s
            if prefill > slo.ttft_s[p]:
                out[p] = prefill
    return out


def replicas_for(load: Trace, engine: EngineModel, slo: Slo, max_replicas: int
                 ) -> tuple[int | None, dict[Priority, float | None]]:
    """The fewest pods, fixed, that meet every class's target on the load (doubling, then bisecting: more pods
    never serve worse); (None, the attainment at max_replicas) when even that many do not."""
    def run(n: int) -> dict[Priority, float | None]:
        return attainment(simulate(requests_of(load, engine), load.duration_s, _Fixed(n), engine, n, 1, 600,
                                   DEFAULT_CAPS), slo)

    per_pod = engine.capacity_rps * max(1, load.duration_s)
    low, high = 0, min(max_replicas, max(1, math.ceil(len(load.rows) / per_pod)))
    seen = run(high)
    while not slo.met(seen):
        if high == max_replicas:
            return None, seen
        low, high = high, min(max_replicas, 2 * high)
        seen = run(high)
    best = seen
    while high - low > 1:
        middle = (low + high) // 2
        tried = run(middle)
        if slo.met(tried):
            high, best = middle, tried
        else:
            low = middle
    return high, best


def recommend(trace: Trace, *, block_size: int | None, kv_bytes_per_token: int, engine: EngineModel, slo: Slo,
              max_tokens: int | None = None, target_qps: float | None = None, max_num_seqs: int | None = None,
              max_position_embeddings: int | None = None, max_replicas: int = 64) -> Plan:
    traffic = describe(trace)
    reasons = [f"The log holds {traffic.requests:,} requests over {traffic.duration_s:,} s: prompts P50 "
               f"{traffic.prompt_p50:,} / P99 {traffic.prompt_p99:,} tokens, outputs P50 {traffic.output_p50:,} / "
               f"P99 {traffic.output_p99:,}; {traffic.mean_qps:.2f} requests/s on average, "
               f"{traffic.peak_qps:.2f} in the busiest minute."]
    if block_size is None:
        block_size, waste = block_size_for(trace)
        reasons.append(f"blockSize {block_size}: the largest block whose empty last slots waste at most "
                       f"{KV_WASTE_TARGET:.0%} of the KV cache for this traffic's sequences halfway through their "
                       f"output ({waste:.1%}" + (")." if waste <= KV_WASTE_TARGET else
                                                 f"; none of {', '.join(map(str, BLOCK_CANDIDATES))} reaches it)."))
    output = max_tokens if max_tokens is not None else traffic.output_p99
    max_model_len = round_up(traffic.prompt_p99 + output, block_size)
    reasons.append(f"maxModelLen {max_model_len:,}: the P99 prompt ({traffic.prompt_p99:,}) plus "
                   + (f"max_tokens {max_tokens:,}" if max_tokens is not None else
                      f"the P99 output ({traffic.output_p99:,})")
                   + f", rounded up to whole blocks of {block_size}. Longer requests (about 1 in 100) are refused "
                     "with a 400 that says so; reserving more context buys them at the cost of every other one.")
    if max_position_embeddings and max_model_len > max_position_embeddings:
        reasons.append(f"The model was trained for {max_position_embeddings:,} positions: maxModelLen is capped "
                       "there; longer prompts need another model.")
        max_model_len = round_up(max_position_embeddings, block_size) - (
            block_size if max_position_embeddings % block_size else 0)
    batch = max_num_seqs or batch_for(engine)
    if max_num_seqs is None:
        reasons.append(f"maxNumSeqs {batch}: the engine's decode throughput grows with the batch and reaches "
                       f"{DECODE_SHARE:.0%} of its limit at {batch} sequences (half at {engine.half_rate_batch:g}, "
                       "measured); a larger batch adds little throughput and more time per token.")
    kv_tokens = round_up(max(max_model_len, math.ceil(batch * traffic.context_p95 * KV_HEADROOM)), block_size)
    reasons.append(f"KV cache {kv_tokens:,} tokens ({kv_tokens * kv_bytes_per_token / 2**20:,.0f} MiB at "
                   f"{kv_bytes_per_token:,} bytes a token): {batch} sequences at the P95 context "
                   f"({traffic.context_p95:,} tokens) with {KV_HEADROOM - 1:.0%} headroom, and at least one "
                   "maxModelLen sequence (the engine refuses to start without room for one). Paged blocks hold only "
                   "the tokens a request has, so this, not maxModelLen x maxNumSeqs, is what the batch needs.")
    qps = target_qps if target_qps is not None else traffic.peak_qps
    sized = with_batch(engine, batch)
    rate = qps * LOAD_TEST_FACTOR
    if rate > max_replicas * sized.capacity_rps:
        reasons.append(f"Replicas > {max_replicas}: {rate:.2f} requests/s ({LOAD_TEST_FACTOR:.0%} of {qps:.2f}) is "
                       f"more than {max_replicas} pods of {sized.capacity_rps:.2f} requests/s each can serve; raise "
                       "--max-replicas or give a faster engine model.")
        return Plan(max_model_len, block_size, batch, kv_tokens, kv_tokens * kv_bytes_per_token, None, qps,
                    dict.fromkeys(Priority), tuple(reasons))
    load = synthetic(trace, rate, max(1, min(SIM_SECONDS, int(MAX_SIM_REQUESTS / rate))))
    impossible = unreachable(load, sized, slo)
    if impossible:
        replicas, met = None, dict.fromkeys(Priority)
        reasons.append("No number of replicas meets " + "; ".join(
            f"{p.value}'s {slo.ttft_s[p]:g} s: the prefill alone of its {slo.attainment[p]:.1%} prompt takes "
            f"{s:.2f} s on this engine ({sized.prefill_tokens_per_s:g} tokens/s)" for p, s in impossible.items())
            + ". A faster engine (--prefill-tokens-per-s), shorter prompts or a looser --slo is needed.")
        return Plan(max_model_len, block_size, batch, kv_tokens, kv_tokens * kv_bytes_per_token, None, qps, met,
                    tuple(reasons))
    replicas, met = replicas_for(load, sized, slo, max_replicas)
    objectives = ", ".join(f"{p.value} TTFT <= {slo.ttft_s[p]:g} s for {slo.attainment[p]:.1%}"
                           for p in Priority if slo.attainment[p] > 0 and traffic.shares[p] > 0)
    reasons.append(f"Replicas {replicas if replicas else f'> {max_replicas}'}: the fewest that meet {objectives} at "
                   f"{qps * LOAD_TEST_FACTOR:.2f} requests/s, {LOAD_TEST_FACTOR:.0%} of "
                   + (f"the target {qps:.2f}" if target_qps is not None else f"the busiest minute's {qps:.2f}")
                   + f" (a {load.duration_s} s replay of requests drawn from the log, each pod "
                     f"{sized.capacity_rps:.2f} requests/s of the benchmark's shape at that batch).")
    return Plan(max_model_len, block_size, batch, kv_tokens, kv_tokens * kv_bytes_per_token, replicas, qps, met,
                tuple(reasons))
