"""What the autoscaler sees of a fleet: each ready pod's load from its /metrics, and the gateway's queue in Redis."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
from kubernetes import client

from kvfleet.gateway.discovery import pod_endpoint
from kvfleet.gateway.load import METRICS_QUERY, MetricsParseError, parse_engine_load
from kvfleet.gateway.redis_queue import queue_key
from kvfleet.operator.autoscaler import PodLoad
from kvfleet.operator.fleet_spec import FleetSpec
from kvfleet.operator.manifests import deployment_name, selector_string

log = logging.getLogger("kvfleet.operator")


def scrape_pod(url: str, timeout_s: float) -> PodLoad:
    """A pod whose /metrics cannot be read counts as a pod without metrics (HPA's missing pods)."""
    try:
        response = httpx.get(f"{url}/metrics?{METRICS_QUERY}", timeout=timeout_s)
        response.raise_for_status()
        load = parse_engine_load(response.text)
    except (httpx.HTTPError, MetricsParseError) as err:
        log.info("no metrics from %s: %s", url, err)
        return PodLoad(None)
    return PodLoad(load.kv_cache_usage, load.num_running, load.num_waiting)


def gateway_queued(redis_url: str | None, fleet: str) -> int:
    """ZCARD of the gateway's documented queue key; 0 when no Redis is configured or it is unreachable."""
    if not redis_url:
        return 0
    import redis

    try:
        with redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2) as r:
            return int(r.zcard(queue_key(fleet)))
    except redis.RedisError as err:
        log.warning("cannot read the gateway queue of %s from Redis: %s", fleet, err)
        return 0


def observe_fleet(fleet: FleetSpec, redis_url: str | None, timeout_s: float) -> tuple[list[PodLoad], int, dict]:
    """(per-pod loads of the ready pods, the gateway's queued count, status fields)."""
    pods = client.CoreV1Api().list_namespaced_pod(namespace=fleet.namespace,
                                                  label_selector=selector_string(fleet.name))
    urls = [u for u in (pod_endpoint(p) for p in pods.items) if u]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        loads = list(pool.map(lambda u: scrape_pod(u, timeout_s), urls))
    queued = gateway_queued(redis_url, fleet.name)
    replicas = ready = 0
    try:
        dep = client.AppsV1Api().read_namespaced_deployment(name=deployment_name(fleet.name),
                                                            namespace=fleet.namespace)
        if dep.status is not None:
            replicas, ready = dep.status.replicas or 0, dep.status.ready_replicas or 0
    except client.ApiException as err:
        if err.status != 404:
            raise
    kv = [p.kv_usage for p in loads if p.kv_usage is not None]
    kv_avg = sum(kv) / len(kv) if kv else 0.0
    status = {"replicas": replicas, "readyReplicas": ready, "kvCacheUsage": round(kv_avg, 3),
              "kvCachePercent": round(kv_avg * 100), "requestsRunning": sum(p.running or 0 for p in loads),
              "requestsWaiting": sum(p.waiting or 0 for p in loads), "gatewayQueued": queued}
    return loads, queued, status
