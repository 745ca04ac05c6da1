"""Prometheus metrics of one engine, named as in ARCHITECTURE.md (the gateway and the operator read them).

Gauges and counters are read from the engine's own counters at scrape time; latency histograms are
observed by the engine thread when a request finishes and after each step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.engine.llm_engine import EngineStats
from kvfleet.engine.outputs import RequestOutput
from kvfleet.fleet import metrics as names

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _StatsCollector(Collector):
    def __init__(self, read_stats) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats: EngineStats | None = self.read_stats()
        if stats is None:
            return
        gauges = {
            names.KV_CACHE_USAGE: ("KV-cache blocks in use, 0-1", stats.kv_cache_usage),
            names.KV_CACHE_BLOCKS_TOTAL: ("KV-cache blocks in the pool", stats.kv_blocks_total),
            names.KV_CACHE_BLOCKS_FREE: ("KV-cache blocks free (cached-but-free count as free)",
                                         stats.kv_blocks_free),
            names.NUM_REQUESTS_RUNNING: ("requests in the running batch", stats.num_running),
            names.NUM_REQUESTS_WAITING: ("requests waiting to be admitted", stats.num_waiting),
            names.MAX_NUM_SEQS: ("the most requests the engine runs at once (--max-num-seqs)",
                                 stats.max_num_seqs),
            names.PREFILL_TOKENS_PENDING: ("prompt tokens waiting or part-computed, to compute before their "
                                           "requests' first tokens", stats.prefill_tokens_pending),
            names.PREFILL_TOKENS_PER_SECOND: ("prompt tokens computed per second in recent steps that computed "
                                              "prompts (a moving average; 0 until measured)",
                                              stats.prefill_tokens_per_second),
            names.REQUEST_SLOT_SECONDS: ("seconds finished requests held a batch slot, first step to last (a moving "
                                         "average; 0 until one finishes)", stats.request_slot_seconds),
            names.DECODE_TOKENS_PER_SECOND_FULL_BATCH: (
                "decode tokens per second at a full batch (max_num_seqs), from a line fitted to recent decode step "
                "times against batch size (0 until steps of two batch sizes)",
                stats.decode_tokens_per_second_full_batch),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            names.NUM_PREEMPTIONS: ("sequences preempted (for KV blocks or a higher-priority request)",
                                    stats.num_preemptions),
            names.PROMPT_TOKENS: ("prompt tokens of requests that produced a token", stats.prompt_tokens),
            names.GENERATION_TOKENS: ("tokens generated", stats.generation_tokens),
            names.PREFIX_CACHE_QUERIES: ("prompt tokens looked up in the prefix cache",
                                         stats.prefix_cache_queries),
            names.PREFIX_CACHE_HITS: ("prompt tokens found in the prefix cache", stats.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        if stats.max_loras:
            info = GaugeMetricFamily(names.LORA_REQUESTS_INFO, "LoRA adapters of running and waiting requests (labels) "
                                     "as of this time (the value)", labels=names.LORA_INFO_LABELS)
            info.add_metric([str(stats.max_loras), ",".join(stats.running_lora_adapters),
                             ",".join(stats.waiting_lora_adapters)], time.time())
            yield info
            yield CounterMetricFamily(names.LORA_ADAPTER_READS, "LoRA adapters read from disk (at registration, or "
                                      "again after eviction from host memory)", value=stats.lora_adapter_reads)
            yield CounterMetricFamily(names.LORA_SLOT_LOADS, "LoRA adapters copied into a slot of the batch's stacked "
                                      "weights", value=stats.lora_slot_loads)


class EngineMetrics:
    def __init__(self, read_stats) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(read_stats))
        r = self.registry
        self.rejected = Counter(names.REQUESTS_REJECTED, "requests refused, by reason", ["reason"], registry=r)
        self.ignored_fields = Counter(names.REQUEST_IGNORED_FIELDS, "unknown request fields ignored", registry=r)
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN, "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(names.INTER_TOKEN_LATENCY, "mean time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(names.E2E_REQUEST_LATENCY, "arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram(names.REQUEST_QUEUE_TIME, "arrival to first scheduled",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram(names.BATCH_SIZE, "sequences in a step", buckets=BATCH_BUCKETS, registry=r)
        self.step = Histogram(names.STEP_SECONDS, "time of one engine step", buckets=LATENCY_BUCKETS, registry=r)
        for reason in ("queue_full", "invalid", "draining", "asleep"):
            self.rejected.labels(reason)
        self.startup = Gauge(names.STARTUP_SECONDS, "seconds of each start-up phase, process start to ready",
                             ["phase"], registry=r)

    def set_startup(self, seconds: dict[str, float]) -> None:
        for phase in names.STARTUP_PHASES:
            if phase in seconds:
                self.startup.labels(phase).set(seconds[phase])

    def observe_step(self, batch_size: int, seconds: float) -> None:
        if batch_size:
            self.batch.observe(batch_size)
            self.step.observe(seconds)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if out.num_output_tokens > 1:
                self.itl.observe((m.finished_time - m.first_token_time) / (out.num_output_tokens - 1))

    def render(self, names: list[str] | None = None) -> bytes:
        """All metrics, or only those named (`/metrics?name[]=...`, as prometheus_client's own handler does)."""
        if names:
            return generate_latest(_Only(self.registry, set(names)))
        return generate_latest(self.registry)


class _Only:
    """The registry's families that carry one of the names (its collectors do not describe themselves, so
    prometheus_client's restricted_registry cannot see the engine's gauges)."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry, self.names = registry, names

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name in self.names or any(sample.name in self.names for sample in family.samples):
                yield family
