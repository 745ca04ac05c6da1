"""kopf handlers: an InferenceFleet's children are reconciled on create, update and resume (and when someone edits
the Deployment); a timer runs the autoscaler. The decisions are pure (fleet_spec, manifests, autoscaler); this
module is the I/O around them, registered with the operator's config by register()."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from kvfleet.fleet.pods import FLEET_LABEL
from kvfleet.fleet.slo_stats import read_class_windows
from kvfleet.operator import metrics
from kvfleet.operator.autoscaler import AutoscalerState, Decision, Observation, recommend
from kvfleet.operator.cold_start import add_starts, cold_start_figure, cold_start_status, saved_samples
from kvfleet.operator.fleet_spec import GROUP, PLURAL, VERSION, FleetSpec, InvalidSpec, parse_fleet
from kvfleet.operator.lora_sync import lora_status, sync_fleet
from kvfleet.operator.manifests import (
    FIELD_MANAGER,
    build_deployment,
    build_service,
    drifted,
    selector_string,
)
from kvfleet.operator.observe import batch_backlog, observe_fleet
from kvfleet.operator.planner import demand_windows
from kvfleet.operator.settings import OperatorConfig
from kvfleet.operator.slo_status import slo_attainment_status
from kvfleet.operator.warm_pool import PodState, asleep_pod_uids, pod_loads, pool_states, settle_warm_pool

log = logging.getLogger("kvfleet.operator")
HISTORY = 5
CHILDREN = {"app.kubernetes.io/managed-by": FIELD_MANAGER}


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": now_iso()}


# Blocking Kubernetes calls (the kubernetes client is synchronous): the handlers run them with asyncio.to_thread.

def _apply(kind: str, desired: dict, read: Callable, create: Callable, patch: Callable) -> str:
    """Create the child, or put back what differs from what we set; returns what was done."""
    meta = desired["metadata"]
    try:
        actual = read(name=meta["name"], namespace=meta["namespace"])
    except ApiException as err:
        if err.status != 404:
            raise
        create(namespace=meta["namespace"], body=desired, field_manager=FIELD_MANAGER)
        return f"created {kind} {meta['name']}"
    actual_dict = client.ApiClient().sanitize_for_serialization(actual)
    diff = drifted(desired, actual_dict)
    if not diff:
        return ""
    patch(name=meta["name"], namespace=meta["namespace"], body=desired, field_manager=FIELD_MANAGER)
    return f"repaired {kind} {meta['name']} ({', '.join(diff[:3])}{'...' if len(diff) > 3 else ''})"


def reconcile_children(fleet: FleetSpec, owner: kopf.Body | dict) -> list[str]:
    deployment = build_deployment(fleet, fleet.pods)
    service = build_service(fleet)
    for child in (deployment, service):
        kopf.adopt(child, owner=owner)
    apps, core = client.AppsV1Api(), client.CoreV1Api()
    done = [_apply("Deployment", deployment, apps.read_namespaced_deployment, apps.create_namespaced_deployment,
                   apps.patch_namespaced_deployment),
            _apply("Service", service, core.read_namespaced_service, core.create_namespaced_service,
                   core.patch_namespaced_service)]
    return [d for d in done if d]


def read_fleet(namespace: str, name: str) -> dict | None:
    """The InferenceFleet as stored now; None when it is gone."""
    try:
        return client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def set_replicas(namespace: str, name: str, replicas: int) -> None:
    client.CustomObjectsApi().patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                             {"spec": {"replicas": replicas}})


@dataclass
class FleetHandlers:
    """The handlers with what they share: the operator's config and each fleet's autoscaler state. The state's
    truth is the fleet's status.autoscaler (read back every tick, so a restarted operator decides the same);
    the copy here only covers a tick whose status has not yet come back through the watch."""

    config: OperatorConfig
    autoscalers: dict[str, AutoscalerState] = field(default_factory=dict)
    # per fleet, its pods (uid) seen asleep in its warm pool: their Ready time is a wake's, not a cold start's
    slept: dict[str, set[str]] = field(default_factory=dict)

    async def reconcile(self, spec: kopf.Spec, name: str, namespace: str, body: kopf.Body, meta: kopf.Meta,
                        patch: kopf.Patch, **_: Any) -> None:
        try:
            fleet = parse_fleet(name, namespace, dict(spec), self.config.engine_api_key_secret)
        except InvalidSpec as err:
            patch.status["conditions"] = [condition("Ready", False, "InvalidSpec", str(err)),
                                          condition("Degraded", True, "InvalidSpec", str(err))]
            kopf.warn(body, reason="InvalidSpec", message=str(err))
            metrics.RECONCILES.labels("invalid_spec").inc()
            raise kopf.PermanentError(str(err)) from err
        for line in await asyncio.to_thread(reconcile_children, fleet, body):
            kopf.info(body, reason="Reconciled", message=line)
        metrics.RECONCILES.labels("ok").inc()
        patch.status["observedGeneration"] = meta.get("generation")
        patch.status["selector"] = selector_string(name)
        patch.status["conditions"] = [condition("Ready", True, "Reconciled", "the engine Deployment and Service "
                                                "match the spec"), condition("Degraded", False, "Reconciled", "")]

    async def child_drift(self, meta: kopf.Meta, namespace: str, **_: Any) -> None:
        """Someone edited or deleted a child: reconcile its fleet again (drift is put back)."""
        fleet_name = (meta.get("labels") or {}).get(FLEET_LABEL)
        if not fleet_name:
            return
        body = await asyncio.to_thread(read_fleet, namespace, fleet_name)
        if body is None:
            return  # the fleet is gone; its children go with it
        try:
            fleet = parse_fleet(fleet_name, namespace, body.get("spec") or {}, self.config.engine_api_key_secret)
        except InvalidSpec:
            return
        for line in await asyncio.to_thread(reconcile_children, fleet, body):
            kopf.info(body, reason="DriftRepaired", message=line)
            metrics.DRIFT_REPAIRS.inc()

    async def autoscale(self, spec: kopf.Spec, name: str, namespace: str, body: kopf.Body, status: kopf.Status,
                        patch: kopf.Patch, **_: Any) -> None:
        try:
            fleet = parse_fleet(name, namespace, dict(spec), self.config.engine_api_key_secret)
        except InvalidSpec:
            return
        pods, queued, counts, pod_objects = await observe_fleet(fleet, self.config.redis_url,
                                                                self.config.scrape_timeout_s)
        if fleet.lora is not None:
            synced = await sync_fleet(fleet, pod_objects, self.config.scrape_timeout_s)
            patch.status.update(lora_status(fleet.lora, synced))
        elif status.get("loraAdapters") is not None:
            patch.status.update({"loraAdapters": None, "loraAdaptersReady": None})
        now = time.time()  # wall-clock time: the windows in the status must mean the same to the next process
        patch.status.update(counts)
        warm: list[PodState] = []
        if fleet.warm_pool is not None:
            warm = await pool_states(pod_objects, pod_loads(pod_objects, pods), self.config.scrape_timeout_s)
        slept = self.slept_pods(f"{namespace}/{name}", pod_objects, warm)
        starts = add_starts(saved_samples(status.get("coldStart")),
                            [p for p in pod_objects if (p.get("metadata") or {}).get("uid") not in slept])
        cold_start_s = cold_start_figure(starts)
        patch.status["coldStart"] = cold_start_status(starts)
        if cold_start_s is not None:
            patch.status["coldStartSeconds"] = cold_start_s
        counted = await read_class_windows(self.config.redis_url, name, fleet.slo_window_s, now)
        patch.status["sloAttainment"] = slo_attainment_status(fleet.autoscaling.slo, counted, fleet.slo_window_s)
        metrics.KV_CACHE_USAGE.labels(namespace, name).set(counts["kvCacheUsage"])
        metrics.GATEWAY_QUEUED.labels(namespace, name).set(queued)
        if fleet.warm_pool is None and status.get("warmPool") is not None:
            patch.status["warmPool"] = None
        if not fleet.autoscaling_enabled:
            if fleet.warm_pool is not None:
                patch.status.update(await settle_warm_pool(fleet, fleet.warm_pool, warm, fleet.replicas,
                                                           not counts["rollingOut"]))
            return
        state = self.autoscaler_state(f"{namespace}/{name}", status)
        window_s, recent_s = demand_windows(fleet.autoscaling.stable_window_s)
        classes = await read_class_windows(self.config.redis_url, name, window_s, now)
        recent = await read_class_windows(self.config.redis_url, name, recent_s, now)
        batch = await batch_backlog(self.config.redis_url, name, now)
        observation = Observation(now, fleet.replicas, tuple(pods), queued, classes=classes, cold_start_s=cold_start_s,
                                  recent_classes=recent, batch=batch, warm_replicas=sum(s.asleep for s in warm),
                                  wake_s=fleet.warm_pool.wake_s if fleet.warm_pool else None)
        decision = recommend(observation, fleet.autoscaling, state)
        patch.status["autoscaler"] = {**state.as_status(), "lastDecision": {
            "time": now_iso(), "desired": decision.desired, "reason": decision.reason,
            "inputs": {**decision.inputs(), "gatewayQueued": queued, "coldStartSeconds": cold_start_s}}}
        metrics.DESIRED_REPLICAS.labels(namespace, name).set(decision.desired)
        if decision.desired != fleet.replicas:
            await asyncio.to_thread(set_replicas, namespace, name, decision.desired)
            record_scaling(fleet, decision, queued, body, status, patch)
        if fleet.warm_pool is not None:  # asleep pods wake for a scale-up now; new ones join the pool when loaded
            patch.status.update(await settle_warm_pool(fleet, fleet.warm_pool, warm, decision.desired,
                                                       not counts["rollingOut"]))

    def slept_pods(self, key: str, pod_objects: list[dict], warm: list[PodState]) -> set[str]:
        """The fleet's pods that have been asleep (kept while they exist), now including those asleep now."""
        alive = {str(uid) for p in pod_objects if (uid := (p.get("metadata") or {}).get("uid"))}
        slept = (self.slept.get(key, set()) & alive) | asleep_pod_uids(pod_objects, warm)
        self.slept[key] = slept
        return slept

    def autoscaler_state(self, key: str, status: kopf.Status) -> AutoscalerState:
        """The fleet's autoscaler state from its status, unless this process holds a newer one."""
        saved = AutoscalerState.from_status(status.get("autoscaler"))
        held = self.autoscalers.get(key)
        state = held if held is not None and held.observed_at > saved.observed_at else saved
        self.autoscalers[key] = state
        return state


def record_scaling(fleet: FleetSpec, decision: Decision, queued: int, body: kopf.Body, status: kopf.Status,
                   patch: kopf.Patch) -> None:
    """A replica change goes into the status (history, time, condition), an Event, a metric and the log."""
    change = f"{fleet.replicas} -> {decision.desired}: {decision.reason}"
    metrics.SCALE_DECISIONS.labels(fleet.namespace, fleet.name,
                                   "up" if decision.desired > fleet.replicas else "down").inc()
    entry = {"time": now_iso(), "from": fleet.replicas, "to": decision.desired, "reason": decision.reason,
             **decision.inputs(), "gatewayQueued": queued}
    patch.status["scalingHistory"] = ([*(status.get("scalingHistory") or []), entry])[-HISTORY:]
    patch.status["lastScaleTime"] = entry["time"]
    patch.status["conditions"] = [condition("Scaling", True, "Scaled", change)]
    kopf.info(body, reason="Scaled", message=change)
    log.info("fleet %s/%s: %s", fleet.namespace, fleet.name, change)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> FleetHandlers:
    """Registers the handlers on `registry`; the timer's interval comes from the config (kopf takes it here)."""
    handlers = FleetHandlers(config)
    fleets = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)
    # The ids are the functions' names before the handlers became methods (kopf keeps progress under them).
    kopf.on.create(**fleets, id="inferencefleet_reconcile")(handlers.reconcile)
    kopf.on.update(**fleets, id="inferencefleet_reconcile", field="spec")(handlers.reconcile)
    kopf.on.resume(**fleets, id="inferencefleet_reconcile")(handlers.reconcile)
    kopf.on.update("apps", "v1", "deployments", id="engine_child_drift", labels=CHILDREN,
                   registry=registry)(handlers.child_drift)
    kopf.on.delete("apps", "v1", "deployments", id="engine_child_drift", labels=CHILDREN, optional=True,
                   registry=registry)(handlers.child_drift)
    kopf.on.delete("", "v1", "services", id="engine_child_drift", labels=CHILDREN, optional=True,
                   registry=registry)(handlers.child_drift)
    interval = config.autoscale_interval_s
    kopf.timer(**fleets, id="inferencefleet_autoscale", interval=interval, initial_delay=min(5.0, interval),
               backoff=interval)(handlers.autoscale)
    return handlers
