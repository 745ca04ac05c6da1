"""The operator's own Prometheus metrics (served by `kvfleet operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RECONCILES = Counter("kvfleet_operator_reconciles", "Fleet reconciliations, by result", ["result"])
DRIFT_REPAIRS = Counter("kvfleet_operator_drift_repairs", "Children put back after someone changed them")
SCALE_DECISIONS = Counter("kvfleet_operator_scale_decisions", "Replica changes the autoscaler made",
                          ["namespace", "fleet", "direction"])
DESIRED_REPLICAS = Gauge("kvfleet_operator_desired_replicas", "The autoscaler's last recommendation",
                         ["namespace", "fleet"])
KV_CACHE_USAGE = Gauge("kvfleet_operator_fleet_kv_cache_usage", "Mean KV-cache usage of a fleet's ready pods",
                 ["namespace", "fleet"])
GATEWAY_QUEUED = Gauge("kvfleet_operator_fleet_gateway_queued", "A fleet's requests waiting at the gateway",
                       ["namespace", "fleet"])
