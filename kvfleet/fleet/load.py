"""An engine's load from its /metrics text: kvfleet's names, or vLLM's so the gateway can front vLLM pods too.

The reader of the metrics contract (kvfleet.fleet.metrics): the gateway's scraper, the operator and bench use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.fleet.metrics import (
    DECODE_TOKENS_PER_SECOND_FULL_BATCH,
    LOAD_SIGNALS,
    MAX_NUM_SEQS,
    PREFILL_TOKENS_PENDING,
    PREFILL_TOKENS_PER_SECOND,
    REQUEST_SLOT_SECONDS,
)


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks a load signal."""


@dataclass(frozen=True)
class EngineLoad:
    kv_cache_usage: float
    num_waiting: int
    num_running: int
    max_num_seqs: int | None = None  # kvfleet engines export it; vLLM's metrics do not
    prefill_tokens_pending: int = 0  # kvfleet engines only, as the next one
    prefill_tokens_per_second: float | None = None  # None: not exported or not measured yet
    request_slot_seconds: float | None = None  # as the previous
    decode_tokens_per_second_full_batch: float | None = None  # as the previous


# What the gateway asks for: /metrics?name[]=... (kvfleet engines filter on it, so they render a few lines instead of
# every histogram; vLLM 0.32 ignores it and renders everything, so the scraper slows down for it: scraper.py).
WANTED = (*(n for names in LOAD_SIGNALS.values() for n in names), MAX_NUM_SEQS, PREFILL_TOKENS_PENDING,
          PREFILL_TOKENS_PER_SECOND, REQUEST_SLOT_SECONDS, DECODE_TOKENS_PER_SECOND_FULL_BATCH)
METRICS_QUERY = "&".join(f"name[]={n}" for n in WANTED)


MAX_VALUE = 1e12  # beyond any real queue, token count or rate


def _sample_values(text: str) -> tuple[dict[str, float], dict[str, int]]:
    """Sums of the wanted samples by name, and how many label sets each summed, from plain exposition lines (name,
    optional labels, value)."""
    found: dict[str, float] = {}
    series: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        if name not in WANTED:
            continue
        fields = rest.split()
        if not fields:
            raise MetricsParseError(f"no value on the line {line[:80]!r}")
        try:
            value = float(fields[0])
        except ValueError:
            raise MetricsParseError(f"cannot read the value on the line {line[:80]!r}") from None
        if not 0.0 <= value <= MAX_VALUE:  # NaN, infinities, negatives: no count or rate is any of them
            raise MetricsParseError(f"the value on the line {line[:80]!r} is not a count in [0, {MAX_VALUE:.0e}]")
        found[name] = found.get(name, 0.0) + value
        series[name] = series.get(name, 0) + 1
    return found, series


def parse_engine_load(text: str) -> EngineLoad:
    """The three load signals: requests summed over label sets (vLLM labels its gauges by model name, and a
    data-parallel pod by engine rank), KV usage averaged over them (each rank has its own cache of the same size)."""
    found, series = _sample_values(text)
    values = {}
    for signal, names in LOAD_SIGNALS.items():
        name = next((n for n in names if n in found), None)
        if name is None:
            raise MetricsParseError(f"no {signal} metric; expected one of {', '.join(names)}")
        values[signal] = found[name] / series[name] if signal == "kv_cache_usage" else found[name]
    capacity = int(found.get(MAX_NUM_SEQS, 0)) or None
    rate = found.get(PREFILL_TOKENS_PER_SECOND, 0.0)
    return EngineLoad(min(max(values["kv_cache_usage"], 0.0), 1.0), int(values["num_waiting"]),
                      int(values["num_running"]), capacity, max(0, int(found.get(PREFILL_TOKENS_PENDING, 0))),
                      rate or None, found.get(REQUEST_SLOT_SECONDS, 0.0) or None,
                      found.get(DECODE_TOKENS_PER_SECOND_FULL_BATCH, 0.0) or None)
