"""An engine's load from its /metrics text: kvfleet's names, or vLLM's so the gateway can front vLLM pods too.

The reader of the metrics contract (kvfleet.fleet.metrics): the gateway's scraper, the operator and bench use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvfleet.fleet.metrics import (
    DECODE_TOKENS_PER_SECOND_FULL_BATCH,
    LOAD_SIGNALS,
    LORA_REQUESTS_INFO,
    MAX_NUM_SEQS,
    PREFILL_TOKENS_PENDING,
    PREFILL_TOKENS_PER_SECOND,
    REQUEST_SLOT_SECONDS,
    VLLM_INFERENCE_SECONDS,
    VLLM_LORA_REQUESTS_INFO,
    VLLM_PREFILL_COMPUTED_TOKENS,
    VLLM_PREFILL_SECONDS,
)


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks a load signal."""


@dataclass(frozen=True)
class LoraInfo:
    """An engine's LoRA state from its lora_requests_info gauge: its adapter cap and the adapters of its running
    and waiting requests."""

    max_loras: int
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RequestTotals:
    """vLLM's running totals over the requests it has finished: how many, their seconds running (their batch slots'
    time), their seconds in prefill and the prompt tokens they computed (not found in the cache)."""

    finished: float
    running_s: float
    prefill_s: float
    computed_tokens: float


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
    lora: LoraInfo | None = None  # None: the engine serves no adapters (or does not say)
    totals: RequestTotals | None = None  # vLLM's; None for kvfleet engines, which export the rates themselves


# The series RequestTotals is read from, in its fields' order (histograms' _count and _sum)
TOTALS = (f"{VLLM_INFERENCE_SECONDS}_count", f"{VLLM_INFERENCE_SECONDS}_sum", f"{VLLM_PREFILL_SECONDS}_sum",
          f"{VLLM_PREFILL_COMPUTED_TOKENS}_sum")

# What the gateway asks for: /metrics?name[]=... (kvfleet engines filter on it, so they render a few lines instead of
# every histogram; vLLM 0.32 ignores it and renders everything, so the scraper slows down for it: scraper.py).
WANTED = (*(n for names in LOAD_SIGNALS.values() for n in names), MAX_NUM_SEQS, PREFILL_TOKENS_PENDING,
          PREFILL_TOKENS_PER_SECOND, REQUEST_SLOT_SECONDS, DECODE_TOKENS_PER_SECOND_FULL_BATCH, LORA_REQUESTS_INFO,
          VLLM_LORA_REQUESTS_INFO, *TOTALS)
LORA_INFO = (LORA_REQUESTS_INFO, VLLM_LORA_REQUESTS_INFO)
METRICS_QUERY = "&".join(f"name[]={n}" for n in WANTED)


MAX_VALUE = 1e12  # beyond any real queue, token count or rate
MAX_ADAPTERS_LISTED = 1024  # adapter names read from one label; an engine listing more is not believed
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _wanted_lines(text: str):
    """The lines of the wanted samples, found with str.find: vLLM renders ~540 lines (~55 KB) of which the load is
    3, and a Python loop over every line took ~0.25 ms a scrape, a quarter of the gateway's scrape CPU (py-spy)."""
    text = "\n" + text
    for name in WANTED:
        key = "\n" + name
        at = text.find(key)
        while at >= 0:
            end = at + len(key)
            if text[end:end + 1] in ("{", " ", "\t"):  # the name whole, not the start of a longer one
                eol = text.find("\n", end)
                yield text[at + 1:eol if eol >= 0 else len(text)]
            at = text.find(key, end)


def _sample_values(text: str) -> tuple[dict[str, float], dict[str, int], str | None]:
    """Sums of the wanted samples by name, how many label sets each summed, and the labels of the newest LoRA info
    sample (its value is the time it was set: vLLM keeps every label set it ever had), from plain exposition lines
    (name, optional labels, value)."""
    found: dict[str, float] = {}
    series: dict[str, int] = {}
    lora_labels, lora_time = None, -1.0
    for line in _wanted_lines(text):
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
        if name in LORA_INFO:
            if value == value and value > lora_time and brace >= 0:  # not NaN
                lora_labels, lora_time = line[brace + 1:line.rfind("}")], value
            continue
        if not 0.0 <= value <= MAX_VALUE:  # NaN, infinities, negatives: no count or rate is any of them
            raise MetricsParseError(f"the value on the line {line[:80]!r} is not a count in [0, {MAX_VALUE:.0e}]")
        found[name] = found.get(name, 0.0) + value
        series[name] = series.get(name, 0) + 1
    return found, series, lora_labels


def parse_lora_info(labels: str) -> LoraInfo:
    """The LoRA state in a lora_requests_info sample's labels (max_lora, running_lora_adapters and
    waiting_lora_adapters, comma-joined); MetricsParseError for labels no engine would write."""
    values = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
              for k, v in _LABEL.findall(labels)}
    try:
        max_loras = int(values.get("max_lora", ""))
    except ValueError:
        raise MetricsParseError("lora_requests_info has no whole-number max_lora label") from None
    if not 0 < max_loras <= MAX_ADAPTERS_LISTED:
        raise MetricsParseError(f"lora_requests_info's max_lora {max_loras} is not from 1 to {MAX_ADAPTERS_LISTED}")
    adapters = {}
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        names = [n for n in values.get(key, "").split(",") if n]
        if len(names) > MAX_ADAPTERS_LISTED:
            raise MetricsParseError(f"lora_requests_info lists more than {MAX_ADAPTERS_LISTED} adapters")
        adapters[key] = frozenset(names)
    return LoraInfo(max_loras, adapters["running_lora_adapters"], adapters["waiting_lora_adapters"])


def parse_engine_load(text: str) -> EngineLoad:
    """The three load signals: requests summed over label sets (vLLM labels its gauges by model name, and a
    data-parallel pod by engine rank), KV usage averaged over them (each rank has its own cache of the same size)."""
    found, series, lora_labels = _sample_values(text)
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
                      found.get(DECODE_TOKENS_PER_SECOND_FULL_BATCH, 0.0) or None,
                      None if lora_labels is None else parse_lora_info(lora_labels), _totals(found))


def _totals(found: dict[str, float]) -> RequestTotals | None:
    """vLLM's request totals, when it exports all of them."""
    if not all(n in found for n in TOTALS):
        return None
    return RequestTotals(*(found[n] for n in TOTALS))
