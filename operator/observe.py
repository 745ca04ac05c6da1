"""What the autoscaler sees of a fleet: each ready pod's load from its /metrics, and the gateway's queue in Redis."""

from __future__ import annotations

import asyncio
import logging

import httpx
from kubernetes import client

from kvfleet.fleet.load import METRICS_QUERY, MetricsParseError, parse_engine_load
from kvfleet.fleet.pods import pod_endpoint
from kvfleet.fleet.redis_keys import batch_backlog_key, queue_key
from kvfleet.operator.autoscaler import PodLoad
from kvfleet.operator.batch_demand import BatchBacklog, parse_backlog
from kvfleet.operator.fleet_spec import FleetSpec
from kvfleet.operator.manifests import deployment_name, selector_string

log = logging.getLogger("kvfleet.operator")


async def scrape_pod(http: httpx.AsyncClient, url: str) -> PodLoad:
    """A pod whose /metrics cannot be read counts as a pod without metrics (HPA's missing pods)."""
    try:
        response = await http.get(f"{url}/metrics?{METRICS_QUERY}")
        response.raise_for_status()
        load = parse_engine_load(response.text)
    except (httpx.HTTPError, MetricsParseError) as err:
        log.info("no metrics from %s: %s", url, err)
        return PodLoad(None)
    return PodLoad(load.kv_cache_usage, load.num_running, load.num_waiting, load.max_num_seqs,
                   load.prefill_tokens_per_second, load.decode_tokens_per_second_full_batch)


async def gateway_queued(redis_url: str | None, fleet: str) -> int:
    """ZCARD of the gateway's documented queue key; 0 when no Redis is configured or it is unreachable."""
    if not redis_url:
        return 0
    import redis
    import redis.asyncio

    try:
        async with redis.asyncio.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2) as r:
            return int(await r.zcard(queue_key(fleet)))
    except redis.RedisError as err:
        log.warning("cannot read the gateway queue of %s from Redis: %s", fleet, err)
        return 0


async def batch_backlog(redis_url: str | None, fleet: str, now: float) -> tuple[BatchBacklog, ...]:
    """The Batch API's unfinished work for this fleet, as the gateways report it; none without Redis."""
    if not redis_url:
        return ()
    import redis
    import redis.asyncio

    try:
        async with redis.asyncio.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2) as r:
            return tuple(parse_backlog((await r.hgetall(batch_backlog_key(fleet))).values(), now))
    except redis.RedisError as err:
        log.warning("cannot read the batch backlog of %s from Redis: %s", fleet, err)
        return ()


def fleet_pods(fleet: FleetSpec) -> list[dict]:
    """The fleet's engine pods as the API's camelCase dicts (a blocking Kubernetes call: run it in a thread)."""
    pods = client.CoreV1Api().list_namespaced_pod(namespace=fleet.namespace,
                                                  label_selector=selector_string(fleet.name))
    return [p.to_dict(serialize=True) for p in pods.items]


def deployment_replicas(fleet: FleetSpec) -> tuple[int, int, bool]:
    """(replicas, ready replicas, a rollout in progress) of the fleet's Deployment; (0, 0, False) before it exists
    (blocking: run in a thread)."""
    try:
        dep = client.AppsV1Api().read_namespaced_deployment(name=deployment_name(fleet.name),
                                                            namespace=fleet.namespace)
    except client.ApiException as err:
        if err.status != 404:
            raise
        return 0, 0, False
    if dep.status is None:
        return 0, 0, False
    replicas = dep.status.replicas or 0
    return replicas, dep.status.ready_replicas or 0, (dep.status.updated_replicas or 0) < replicas


async def observe_fleet(fleet: FleetSpec, redis_url: str | None,
                        timeout_s: float) -> tuple[list[PodLoad], int, dict, list[dict]]:
    """(per-pod loads of the ready pods, the gateway's queued count, status fields, all the fleet's pods for the
    cold start's measure). The Kubernetes client blocks, so its calls run in threads; the scrapes and Redis are
    async, so the event loop never waits."""
    pods = await asyncio.to_thread(fleet_pods, fleet)
    urls = [u for u in map(pod_endpoint, pods) if u]
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        loads = await asyncio.gather(*(scrape_pod(http, u) for u in urls))
    queued = await gateway_queued(redis_url, fleet.name)
    replicas, ready, rolling_out = await asyncio.to_thread(deployment_replicas, fleet)
    kv = [p.kv_cache_usage for p in loads if p.kv_cache_usage is not None]
    kv_cache_usage_avg = sum(kv) / len(kv) if kv else 0.0
    status = {"replicas": replicas, "readyReplicas": ready, "kvCacheUsage": round(kv_cache_usage_avg, 3),
              "kvCachePercent": round(kv_cache_usage_avg * 100), "requestsRunning": sum(p.running or 0 for p in loads),
              "requestsWaiting": sum(p.waiting or 0 for p in loads), "gatewayQueued": queued,
              "rollingOut": rolling_out}
    return loads, queued, status, pods
