"""What the gateway learns of an engine's scheduling where the engine does not say it (vLLM): its batch capacity,
how long a request holds a batch slot, the prompt tokens a request computes and how fast. kvfleet's engine exports
these (kvfleet_max_num_seqs, kvfleet_request_slot_seconds, kvfleet_prefill_tokens_pending and _per_second); vLLM
exports only its counts and per-request histograms, and without them the routing's time-to-first-token estimate
(routing/ttft.py) sees a full vLLM batch as free and its waiting list as costless, and the fleet queue releases to a
vLLM engine by its queue limit rather than its free slots.

- Batch capacity: the most requests seen running at a scrape that showed requests waiting (the scheduler runs every
  request it can, so a waiting one means the batch or the KV cache is full), and never less than the most seen
  running since. Unknown until the engine is first seen full.
- Slot time, computed tokens per request, prefill rate: moving averages over the requests finished between two
  scrapes, from vLLM's request_inference_time, request_prefill_time and request_prefill_kv_computed_tokens.
- Pending prefill: the requests waiting times the computed tokens per request.

Pure: `learn` takes what was known and a scrape, `filled` gives the load as routing should see it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvfleet.fleet.load import EngineLoad, RequestTotals

WEIGHT = 0.2  # a new interval's share in each moving average: about the last five scrapes that finished requests


@dataclass(frozen=True)
class Learned:
    batch: int | None = None  # the engine's batch capacity as seen; None: never seen full
    slot_s: float | None = None  # seconds a request runs (holds a slot)
    computed_tokens: float | None = None  # prompt tokens a request computes (its cache misses)
    prefill_rate: float | None = None  # prompt tokens per second of prefill
    totals: RequestTotals | None = None  # the engine's totals at the last scrape


def _average(known: float | None, new: float) -> float:
    return new if known is None else (1.0 - WEIGHT) * known + WEIGHT * new


def learn(known: Learned, load: EngineLoad) -> Learned:
    """What is known after this scrape. An engine that exports no totals (a kvfleet engine) learns nothing; totals
    that went down are a restarted engine's: counted from there."""
    now = load.totals
    if now is None:
        return known
    batch = known.batch
    if load.num_waiting > 0 and load.num_running > 0:
        batch = max(batch or 0, load.num_running)
    elif batch is not None:
        batch = max(batch, load.num_running)
    slot_s, tokens, rate = known.slot_s, known.computed_tokens, known.prefill_rate
    before = known.totals
    if before is not None and now.finished > before.finished and now.running_s >= before.running_s:
        finished = now.finished - before.finished
        slot_s = _average(slot_s, (now.running_s - before.running_s) / finished)
        computed = max(0.0, now.computed_tokens - before.computed_tokens)
        tokens = _average(tokens, computed / finished)
        prefill_s = now.prefill_s - before.prefill_s
        if computed > 0 and prefill_s > 0:
            rate = _average(rate, computed / prefill_s)
    return Learned(batch, slot_s, tokens, rate, now)


def filled(load: EngineLoad, known: Learned) -> EngineLoad:
    """The load with what the engine does not export taken from what was learnt (nothing for an engine that exports
    them itself: one without vLLM's totals)."""
    if load.totals is None:
        return load
    return replace(load, max_num_seqs=known.batch, request_slot_seconds=known.slot_s,
                   prefill_tokens_pending=round(load.num_waiting * (known.computed_tokens or 0.0)),
                   prefill_tokens_per_second=known.prefill_rate)
