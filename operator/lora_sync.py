"""The fleet's adapters on each ready engine pod: what a pod serves is read from its GET /v1/models, the difference
from spec.loraAdapters is planned (pure), and made up with the engines' runtime API (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, vLLM's, behind the engines' token). Runs every autoscaler period, so an adapter added to or
removed from a live fleet is served or gone within one period, and a new pod gets the fleet's adapters as soon as it
is ready. Only adapters from the fleet's store are ever unloaded: ones an engine was started with stay.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass, field

import httpx
from kubernetes import client
from kubernetes.client.rest import ApiException

from kvfleet.fleet import headers
from kvfleet.fleet.pods import pod_endpoint
from kvfleet.operator.fleet_spec import FleetSpec
from kvfleet.operator.lora_spec import FleetAdapter, FleetLora

log = logging.getLogger("kvfleet.operator")
LOAD_TIMEOUT_S = 60.0  # an engine reads and checks the whole adapter before it answers
MAX_MODELS_BODY = 1 << 20
MAX_ERROR = 300


@dataclass(frozen=True)
class Served:
    """An adapter a pod serves: its directory there, and whether it is pinned (kvfleet's engines say)."""

    root: str
    pinned: bool = False


@dataclass
class PodAdapters:
    """One pod after a sync: the adapters it serves, and the engine's answer for each adapter that failed."""

    pod: str
    served: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    reachable: bool = True


def served_adapters(body: object) -> dict[str, Served]:
    """The adapters in a /v1/models answer (entries with a parent), by name."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("a /v1/models answer lists models under data")
    return {m["id"]: Served(str(m.get("root") or ""), m.get("pinned") is True) for m in data
            if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)}


def plan_pod(lora: FleetLora, served: dict[str, Served], runtime: str) -> tuple[list[FleetAdapter], list[str]]:
    """(adapters to load, names to unload first): the spec's adapters a pod lacks, or serves from another directory
    (or, on kvfleet's engines, pinned otherwise), are loaded; adapters from the store the spec no longer names, or
    that are loaded again, are unloaded. Adapters from elsewhere (an engine's own --lora-modules) are left alone."""
    wanted = {a.name: a for a in lora.adapters}
    load, unload = [], []
    for name, have in served.items():
        want = wanted.get(name)
        if want is None:
            if have.root.startswith(lora.root + "/"):
                unload.append(name)
        elif have.root != lora.path_of(want) or (runtime == "kvfleet" and have.pinned != want.pinned):
            unload.append(name)
            load.append(want)
    load += [a for a in lora.adapters if a.name not in served]
    return load, unload


def _error(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return f"{response.status_code}: {str(message)[:MAX_ERROR]}"


async def sync_pod(http: httpx.AsyncClient, pod: str, url: str, fleet: FleetSpec) -> PodAdapters:
    """Make one pod serve the spec's adapters; what it serves afterwards, and why any failed."""
    out = PodAdapters(pod)
    try:
        response = await http.get(f"{url}/v1/models")
        response.raise_for_status()
        if len(response.content) > MAX_MODELS_BODY:
            raise ValueError(f"a /v1/models answer over {MAX_MODELS_BODY} bytes")
        served = served_adapters(response.json())
    except (httpx.HTTPError, ValueError) as err:
        log.info("cannot read the adapters of %s (%s): %s", pod, url, err)
        return PodAdapters(pod, reachable=False)
    load, unload = plan_pod(fleet.lora, served, fleet.runtime)
    for name in unload:
        try:
            done = await http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.HTTPError as err:
            out.errors[name] = f"no answer: {err}"
            continue
        if done.status_code in (200, 404):
            served.pop(name, None)
            log.info("unloaded LoRA adapter %s from %s", name, pod)
        else:
            out.errors[name] = _error(done)
    for adapter in load:
        body = {"lora_name": adapter.name, "lora_path": fleet.lora.path_of(adapter)}
        if fleet.runtime == "kvfleet" and adapter.pinned:
            body["pinned"] = True
        try:
            done = await http.post(f"{url}/v1/load_lora_adapter", json=body, timeout=LOAD_TIMEOUT_S)
        except httpx.HTTPError as err:
            out.errors[adapter.name] = f"no answer: {err}"
            continue
        if done.status_code == 200:
            served[adapter.name] = Served(fleet.lora.path_of(adapter), adapter.pinned)
            log.info("loaded LoRA adapter %s on %s", adapter.name, pod)
        else:
            out.errors[adapter.name] = _error(done)
    out.served = set(served)
    return out


def engine_token(fleet: FleetSpec) -> str | None:
    """The engines' token from the fleet's Secret (a blocking Kubernetes call: run it in a thread); None without
    one, or when the Secret cannot be read (the loads then fail with the engine's 401, shown in the status)."""
    if not fleet.api_key_secret:
        return None
    try:
        secret = client.CoreV1Api().read_namespaced_secret(name=fleet.api_key_secret, namespace=fleet.namespace)
    except ApiException as err:
        log.warning("cannot read Secret %s/%s for the engines' token: %s", fleet.namespace, fleet.api_key_secret,
                    err.reason)
        return None
    value = (secret.data or {}).get(fleet.api_key_secret_key)
    return base64.b64decode(value).decode() if value else None


async def sync_fleet(fleet: FleetSpec, pods: list[dict], timeout_s: float) -> list[PodAdapters]:
    """Every ready pod of the fleet, synced at once."""
    ready = [(p["metadata"]["name"], url) for p in pods if (url := pod_endpoint(p))]
    token = await asyncio.to_thread(engine_token, fleet)
    auth = {headers.AUTHORIZATION: f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth) as http:
        return list(await asyncio.gather(*(sync_pod(http, name, url, fleet) for name, url in ready)))


def lora_status(lora: FleetLora, pods: list[PodAdapters]) -> dict:
    """status.loraAdapters (each adapter's pods, and a failed load's answer) and status.loraAdaptersReady."""
    entries, everywhere = [], 0
    reached = [p for p in pods if p.reachable]
    for adapter in lora.adapters:
        holding = sorted(p.pod for p in reached if adapter.name in p.served)
        entry: dict = {"name": adapter.name, "pods": holding}
        error = next((f"{p.pod}: {p.errors[adapter.name]}" for p in reached if adapter.name in p.errors), None)
        if error:
            entry["error"] = error
        entries.append(entry)
        everywhere += bool(reached) and len(holding) == len(reached)
    return {"loraAdapters": entries, "loraAdaptersReady": f"{everywhere}/{len(lora.adapters)}"}
