"""spec.autoscaling.warmPool: replicas kept asleep with the model loaded (the engines' sleep mode), woken when the
autoscaler wants more replicas: serving again in about a second where a new pod takes its cold start (llm-d's "fast
model actuation", vLLM's sleep mode). The Deployment runs spec.replicas + warmPool.replicas pods; every autoscaler
period the operator asks each running pod GET /is_sleeping, wakes asleep pods while fewer are awake than
spec.replicas, and puts idle awake pods beyond it to sleep while the pool is short (POST /wake_up, POST /sleep?level=1,
behind the engines' token). An asleep pod is not Ready (its /ready says `sleeping`), so no Service or gateway sends
it requests; the autoscaler plans against the wake time while the pool has pods asleep.

The plan is pure (plan_warm_pool); the calls are at the edge (sync_warm_pool).
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
    """One running engine pod as the sync sees it: its URL, asleep or not, and idle (nothing running or waiting)."""

    url: str
    asleep: bool
    idle: bool = False


def plan_warm_pool(pods: list[PodState], active: int, pool: int) -> tuple[list[str], list[str]]:
    """(pods to wake, pods to put to sleep): asleep pods are woken while fewer than `active` are awake; idle awake
    pods beyond `active` go to sleep while fewer than `pool` sleep. Pods still loading are in neither list (they
    count once they answer)."""
    awake = [p for p in pods if not p.asleep]
    asleep = [p for p in pods if p.asleep]
    wake = [p.url for p in asleep[:max(0, active - len(awake))]]
    spare = max(0, len(awake) - active)
    room = max(0, pool - len(asleep))
    sleep = [p.url for p in awake if p.idle][:min(spare, room)]
    return wake, sleep


async def pod_state(http: httpx.AsyncClient, url: str, ready: bool, idle: bool) -> PodState | None:
    """What /is_sleeping says; None for a pod that does not answer it yet (loading) or at all."""
    try:
        response = await http.get(f"{url}/is_sleeping")
        response.raise_for_status()
        asleep = response.json().get("is_sleeping")
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        log.debug("no sleep state from %s: %s", url, err)
        return None
    if not isinstance(asleep, bool) or (not asleep and not ready):
        return None  # awake but not Ready yet: loading, or its readiness not seen yet
    return PodState(url, asleep, idle)


def idle_urls(pod_objects: list[dict], loads: list[PodLoad]) -> set[str]:
    """The ready pods with nothing running or waiting, from observe_fleet's loads (in the ready pods' order)."""
    urls = [u for u in map(pod_endpoint, pod_objects) if u]
    return {u for u, load in zip(urls, loads, strict=False) if load.running == 0 and load.waiting == 0}


async def pool_states(pod_objects: list[dict], idle: set[str], timeout_s: float) -> list[PodState]:
    """Each running pod that answers /is_sleeping: asleep, or awake and Ready (idle when in `idle`)."""
    urls = [(url, pod_endpoint(p) is not None) for p in pod_objects if (url := running_pod_url(p))]
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        found = await asyncio.gather(*(pod_state(http, u, ready, u in idle) for u, ready in urls))
    return [s for s in found if s is not None]


async def settle_warm_pool(fleet: FleetSpec, pool: WarmPool, states: list[PodState], active: int) -> dict:
    """Wake and sleep the fleet's pods toward `active` awake and `pool.replicas` asleep; the status it reports."""
    wake, sleep = plan_warm_pool(states, active, pool.replicas)
    woken = slept = 0
    if wake or sleep:
        token = await asyncio.to_thread(engine_token, fleet)
        auth = {headers.AUTHORIZATION: f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(timeout=SLEEP_TIMEOUT_S, headers=auth) as admin:
            results = await asyncio.gather(*(_call(admin, u, "/wake_up") for u in wake),
                                           *(_call(admin, u, "/sleep?level=1") for u in sleep))
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
    if response.status_code != 200:  # 409: a request came in meanwhile; the next period tries again
        log.info("%s%s answered %d: %s", url, path, response.status_code, response.text[:300])
        return False
    return True
