"""spec.autoscaling.warmPool: replicas kept asleep with the model loaded (the engines' sleep mode), woken when the
autoscaler wants more replicas: serving again in about a second where a new pod takes its cold start (llm-d's "fast
model actuation", vLLM's sleep mode). The Deployment runs spec.replicas + warmPool.replicas pods; every autoscaler
period the operator asks each running pod GET /is_sleeping, wakes asleep pods while fewer are awake than
spec.replicas, and puts the least-loaded awake pods beyond it to sleep while the pool is short (POST /wake_up,
POST /sleep?level=1&drain=true: the pod leaves the Service at once and sleeps when its requests end; behind the
engines' token). An asleep pod is not Ready (its /ready says `sleeping`), so no Service or gateway sends it
requests; the autoscaler plans against the wake time while the pool has pods asleep. During a rollout no pod is put
to sleep (an asleep new pod would count as unavailable and stall it), and the Deployment allows as many unavailable
pods as the pool has.

The plan is pure (plan_warm_pool); the calls are at the edge (pool_states reads, settle_warm_pool acts).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from kvfleet.fleet import headers
from kvfleet.fleet.pods import pod_endpoint, running_pod_url
from kvfleet.operator.autoscaler import PodLoad
from kvfleet.operator.fleet_spec import FleetSpec
from kvfleet.operator.lora_sync import engine_token
from kvfleet.operator.warm_pool_spec import WarmPool

log = logging.getLogger("kvfleet.operator")
SLEEP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PodState:
    """One running engine pod as the sync sees it: its URL, asleep (or asleep once its requests end), and its
    load (requests running and waiting at the last scrape; None: not scraped)."""

    url: str
    asleep: bool
    load: int | None = None


def plan_warm_pool(pods: list[PodState], active: int, pool: int,
                   may_sleep: bool = True) -> tuple[list[str], list[str]]:
    """(pods to wake, pods to put to sleep): asleep pods are woken while fewer than `active` are awake; awake pods
    beyond `active` go to sleep, the least loaded first, while fewer than `pool` sleep (they leave the Service at
    once and sleep when their requests end: a pod under steady traffic is never idle). `may_sleep` False (a rollout
    in progress: an asleep new pod would count as unavailable and stall it) puts none to sleep. Pods still loading
    are in neither list (they count once they answer)."""
    awake = [p for p in pods if not p.asleep]
    asleep = [p for p in pods if p.asleep]
    wake = [p.url for p in asleep[:max(0, active - len(awake))]]
    spare = max(0, len(awake) - active)
    room = max(0, pool - len(asleep)) if may_sleep else 0
    by_load = sorted(awake, key=lambda p: (p.load is None, p.load or 0))
    sleep = [p.url for p in by_load][:min(spare, room)]
    return wake, sleep


async def pod_state(http: httpx.AsyncClient, url: str, ready: bool, load: int | None) -> PodState | None:
    """What /is_sleeping says; None for a pod that does not answer it yet (loading) or at all."""
    try:
        response = await http.get(f"{url}/is_sleeping")
        response.raise_for_status()
        body = response.json()
        asleep, pending = body.get("is_sleeping"), body.get("sleep_pending", False)
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        log.debug("no sleep state from %s: %s", url, err)
        return None
    if not isinstance(asleep, bool) or not isinstance(pending, bool):
        return None
    if not (asleep or pending) and not ready:
        return None  # awake but not Ready yet: loading, or its readiness not seen yet
    return PodState(url, asleep or pending, load)


def pod_loads(pod_objects: list[dict], loads: list[PodLoad]) -> dict[str, int]:
    """Requests running and waiting on each scraped ready pod, from observe_fleet's loads (the ready pods' order)."""
    urls = [u for u in map(pod_endpoint, pod_objects) if u]
    return {u: (load.running or 0) + (load.waiting or 0) for u, load in zip(urls, loads, strict=False)
            if load.has_metrics}


def asleep_pod_uids(pod_objects: list[dict], states: list[PodState]) -> set[str]:
    """The uids of the pods asleep (or about to be): their next Ready is a wake, not a cold start."""
    asleep = {s.url for s in states if s.asleep}
    return {str(uid) for p in pod_objects if running_pod_url(p) in asleep
            and (uid := (p.get("metadata") or {}).get("uid"))}


async def pool_states(pod_objects: list[dict], loads: dict[str, int], timeout_s: float) -> list[PodState]:
    """Each running pod that answers /is_sleeping: asleep (or about to be), or awake and Ready."""
    urls = [(url, pod_endpoint(p) is not None) for p in pod_objects if (url := running_pod_url(p))]
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        found = await asyncio.gather(*(pod_state(http, u, ready, loads.get(u)) for u, ready in urls))
    return [s for s in found if s is not None]


async def settle_warm_pool(fleet: FleetSpec, pool: WarmPool, states: list[PodState], active: int,
                           may_sleep: bool = True) -> dict:
    """Wake and sleep the fleet's pods toward `active` awake and `pool.replicas` asleep; the status it reports."""
    wake, sleep = plan_warm_pool(states, active, pool.replicas, may_sleep)
    woken = slept = 0
    if wake or sleep:
        token = await asyncio.to_thread(engine_token, fleet)
        auth = {headers.AUTHORIZATION: f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(timeout=SLEEP_TIMEOUT_S, headers=auth) as admin:
            results = await asyncio.gather(*(_call(admin, u, "/wake_up") for u in wake),
                                           *(_call(admin, u, "/sleep?level=1&drain=true") for u in sleep))
        woken, slept = sum(results[:len(wake)]), sum(results[len(wake):])
    asleep = sum(s.asleep for s in states) - woken + slept
    if wake or sleep:
        log.info("fleet %s/%s warm pool: woke %d, put %d to sleep; %d asleep of %d", fleet.namespace, fleet.name,
                 woken, slept, asleep, pool.replicas)
    return {"warmPool": {"replicas": pool.replicas, "asleep": asleep, "woken": woken, "slept": slept}}


async def _call(http: httpx.AsyncClient, url: str, path: str) -> bool:
    try:
        response = await http.post(f"{url}{path}")
    except httpx.HTTPError as err:
        log.warning("%s%s failed: %s", url, path, err)
        return False
    if response.status_code not in (200, 202):  # 202: asleep once its requests end
        log.info("%s%s answered %d: %s", url, path, response.status_code, response.text[:300])
        return False
    return True
