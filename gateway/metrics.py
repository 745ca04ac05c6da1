"""The gateway's Prometheus metrics (kvfleet_gateway_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvfleet_gateway_requests", "Requests answered, by class and HTTP status",
                                ["priority", "code"], registry=r)
        self.queue_depth = Gauge("kvfleet_gateway_queue_depth", "Requests waiting in the fleet queue, by class",
                                 ["priority"], registry=r)
        self.queue_drain_rate = Gauge("kvfleet_gateway_queue_drain_rate",
                                      "Requests the fleet queue released per second over the last 10 s, fleet-wide: "
                                      "the rate deadline refusals and Retry-After are computed from (0: too few "
                                      "releases to tell)", registry=r)
        self.queue_wait = Histogram("kvfleet_gateway_queue_wait_seconds", "Time requests waited in the fleet queue",
                                    ["priority"], buckets=LATENCY_BUCKETS, registry=r)
        self.shed = Counter("kvfleet_gateway_shed", "Requests refused without reaching an engine",
                            ["priority", "reason"], registry=r)
        self.degraded = Counter("kvfleet_gateway_degraded", "Requests served degraded while the fleet was saturated, "
                                "by the ladder's step", ["priority", "step"], registry=r)
        self.routed = Counter("kvfleet_gateway_routed", "Requests sent to each engine", ["endpoint"], registry=r)
        # adapters are named by the engines (their /v1/models), never by a client: the label set stays bounded
        self.lora_requests = Counter("kvfleet_gateway_lora_requests", "Requests for each LoRA adapter, sent to an "
                                     "engine", ["adapter"], registry=r)
        self.lora_tokens = Counter("kvfleet_gateway_lora_tokens", "Tokens the engines reported for each LoRA "
                                   "adapter's answers: prompt or completion", ["adapter", "kind"], registry=r)
        self.batch_requests = Counter("kvfleet_gateway_batch_requests", "Batch API requests answered by this "
                                      "replica's runner: completed (a 2xx answer) or failed", ["outcome"], registry=r)
        self.batch_in_flight = Gauge("kvfleet_gateway_batch_in_flight", "Batch API requests this replica has at the "
                                     "engines now", registry=r)
        self.upstream_latency = Histogram("kvfleet_gateway_upstream_latency_seconds",
                                          "Time from sending to an engine to its response headers",
                                          ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.migrations = Counter("kvfleet_gateway_migrations", "Answers an engine ended without the model's end, by "
                                  "cause (aborted, broken, timeout, error) and outcome (continued on another engine, "
                                  "resent whole, failed)", ["cause", "outcome"], registry=r)
        self.retries = Counter("kvfleet_gateway_retries", "Requests retried on another engine", ["reason"],
                               registry=r)
        self.ejections = Counter("kvfleet_gateway_ejections", "Engines ejected after repeated failures",
                                 ["endpoint"], registry=r)
        self.scrape_age = Gauge("kvfleet_gateway_scrape_age_seconds", "Age of each engine's last good scrape",
                                ["endpoint"], registry=r)
        self.scrape_interval = Gauge("kvfleet_gateway_scrape_interval_seconds",
                                     "How often each engine's /metrics is read (longer where rendering it is costly)",
                                     ["endpoint"], registry=r)
        self.endpoints = Gauge("kvfleet_gateway_endpoints", "Engines by state", ["state"], registry=r)
        self.batch_capacity = Gauge("kvfleet_gateway_engine_batch_capacity",
                                    "Each engine's batch capacity as routing sees it: exported (kvfleet engines) or "
                                    "learnt from its scrapes (vLLM; 0 until first seen full)", ["endpoint"], registry=r)
        self.slot_seconds = Gauge("kvfleet_gateway_engine_slot_seconds",
                                  "How long a request holds one of each engine's batch slots, as routing sees it: "
                                  "exported, or learnt from vLLM's request histograms (0: not known yet)",
                                  ["endpoint"], registry=r)
        self.routing_decisions = Counter(
            "kvfleet_gateway_routing_decisions", "Engines chosen, by what decided: prefix_precise or "
            "prefix_approximate (the engine holding the most of the prompt, from KV events or the approximate table), "
            "load (no engine held any of it, or a less loaded one won)", ["reason"], registry=r)
        self.kv_index_blocks = Gauge("kvfleet_gateway_kv_index_blocks",
                                     "Prefix-cache blocks each engine holds, as its KV events report them",
                                     ["endpoint"], registry=r)
        self.kv_event_lag = Histogram("kvfleet_gateway_kv_event_lag_seconds",
                                      "Time from an engine publishing a KV-event batch to this gateway applying it",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.redis_up = Gauge("kvfleet_gateway_redis_up",
                              "1 while the fleet queue is in Redis, 0 while this replica queues in-process",
                              registry=r)
        # Per tenant: the top N tenants by traffic by name, the rest "other" (gateway/limits/tenant_metrics.py).
        self.tenant_queued = Gauge("kvfleet_gateway_tenant_queued", "This replica's requests waiting in the fleet "
                                   "queue, by tenant", ["tenant"], registry=r)
        self.tenant_served_tokens = Counter("kvfleet_gateway_tenant_served_tokens", "Tokens (prompt + completion) "
                                            "the engines reported for each tenant's answers", ["tenant"], registry=r)
        self.tenant_queue_wait = Histogram("kvfleet_gateway_tenant_queue_wait_seconds", "Time each tenant's "
                                           "requests waited in the fleet queue", ["tenant"], buckets=LATENCY_BUCKETS,
                                           registry=r)
        self.tenant_shed = Counter("kvfleet_gateway_tenant_shed", "Each tenant's requests refused without reaching "
                                   "an engine", ["tenant", "reason"], registry=r)

    def labelled(self, metric: MetricWrapperBase, *values: str) -> MetricWrapperBase:
        """`metric.labels(*values)`, looked up once: labels() takes a lock and checks its arguments on every call,
        a cost on each request's path. Label sets here are few (classes, codes, engines) and never removed."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child
