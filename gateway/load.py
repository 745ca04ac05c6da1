"""An engine's load from its /metrics text: kvfleet's names, or vLLM's so the gateway can front vLLM pods too."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# For each signal, the names that carry it, in order of preference.
SIGNALS = {
    "kv_cache_usage": ("kvfleet_kv_cache_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "num_waiting": ("kvfleet_num_requests_waiting", "vllm:num_requests_waiting"),
    "num_running": ("kvfleet_num_requests_running", "vllm:num_requests_running"),
}


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks a load signal."""


@dataclass(frozen=True)
class EngineLoad:
    kv_cache_usage: float
    num_waiting: int
    num_running: int
    max_num_seqs: int | None = None  # kvfleet engines export it; vLLM's metrics do not


def parse_engine_load(text: str) -> EngineLoad:
    """The three load signals, summed over label sets (vLLM labels its gauges by model name)."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    except ValueError as err:
        raise MetricsParseError(f"cannot parse the metrics text: {err}") from err
    values = {}
    for signal, names in SIGNALS.items():
        name = next((n for n in names if n in found), None)
        if name is None:
            raise MetricsParseError(f"no {signal} metric; expected one of {', '.join(names)}")
        values[signal] = found[name]
    capacity = int(found.get("kvfleet_max_num_seqs", 0)) or None
    return EngineLoad(min(max(values["kv_cache_usage"], 0.0), 1.0), int(values["num_waiting"]),
                      int(values["num_running"]), capacity)
