"""kopf handlers: an InferenceFleet's children are reconciled on create, update and resume (and when someone edits
the Deployment); a timer runs the autoscaler. The decisions are pure (fleet_spec, manifests, autoscaler); this
module is the I/O around them."""

from __future__ import annotations

import datetime
import logging
import os
import time

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from kvfleet.operator import metrics
from kvfleet.operator.autoscaler import AutoscalerState, Observation, recommend
from kvfleet.operator.fleet_spec import GROUP, PLURAL, VERSION, FleetSpec, InvalidSpec, parse_fleet
from kvfleet.operator.manifests import (
    FIELD_MANAGER,
    build_deployment,
    build_service,
    drifted,
    selector_string,
)
from kvfleet.operator.observe import observe_fleet
from kvfleet.operator.settings import OperatorConfig

log = logging.getLogger("kvfleet.operator")
HISTORY = 5
# kopf takes a timer's interval when the handler is registered, so `kvfleet operator --autoscale-interval`
# sets this variable before this module is imported.
AUTOSCALE_INTERVAL_S = float(os.environ.get("KVFLEET_AUTOSCALE_INTERVAL", "15"))


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str) -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": now_iso()}


def _apply(kind: str, desired: dict, read, create, patch) -> str:
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


def _api_key_secret(memo) -> str | None:
    """The operator's --engine-api-key-secret: the engines' token Secret for fleets whose spec names none."""
    config: OperatorConfig = memo.get("config") or OperatorConfig()
    return config.engine_api_key_secret


def reconcile_children(fleet: FleetSpec, owner: dict) -> list[str]:
    deployment = build_deployment(fleet, fleet.replicas)
    service = build_service(fleet)
    for child in (deployment, service):
        kopf.adopt(child, owner=owner)
    apps, core = client.AppsV1Api(), client.CoreV1Api()
    done = [_apply("Deployment", deployment, apps.read_namespaced_deployment, apps.create_namespaced_deployment,
                   apps.patch_namespaced_deployment),
            _apply("Service", service, core.read_namespaced_service, core.create_namespaced_service,
                   core.patch_namespaced_service)]
    return [d for d in done if d]


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
def inferencefleet_reconcile(spec, name, namespace, body, meta, patch, memo, **_) -> None:
    try:
        fleet = parse_fleet(name, namespace, dict(spec), _api_key_secret(memo))
    except InvalidSpec as err:
        patch.status["conditions"] = [condition("Ready", False, "InvalidSpec", str(err)),
                                      condition("Degraded", True, "InvalidSpec", str(err))]
        kopf.warn(body, reason="InvalidSpec", message=str(err))
        metrics.RECONCILES.labels("invalid_spec").inc()
        raise kopf.PermanentError(str(err)) from err
    for line in reconcile_children(fleet, body):
        kopf.info(body, reason="Reconciled", message=line)
    metrics.RECONCILES.labels("ok").inc()
    patch.status["observedGeneration"] = meta.get("generation")
    patch.status["selector"] = selector_string(name)
    patch.status["conditions"] = [condition("Ready", True, "Reconciled", "the engine Deployment and Service match "
                                            "the spec"), condition("Degraded", False, "Reconciled", "")]


@kopf.on.update("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": FIELD_MANAGER})
@kopf.on.delete("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": FIELD_MANAGER},
                optional=True)
@kopf.on.delete("", "v1", "services", labels={"app.kubernetes.io/managed-by": FIELD_MANAGER}, optional=True)
def engine_child_drift(meta, namespace, memo, **_) -> None:
    """Someone edited or deleted a child: reconcile its fleet again (drift is put back)."""
    fleet_name = (meta.get("labels") or {}).get("kvfleet.io/fleet")
    if not fleet_name:
        return
    try:
        body = client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, fleet_name)
    except ApiException as err:
        if err.status == 404:
            return  # the fleet is gone; its children go with it
        raise
    try:
        fleet = parse_fleet(fleet_name, namespace, body.get("spec") or {}, _api_key_secret(memo))
    except InvalidSpec:
        return
    for line in reconcile_children(fleet, body):
        kopf.info(body, reason="DriftRepaired", message=line)
        metrics.DRIFT_REPAIRS.inc()


@kopf.timer(GROUP, VERSION, PLURAL, interval=AUTOSCALE_INTERVAL_S, initial_delay=min(5.0, AUTOSCALE_INTERVAL_S),
            backoff=AUTOSCALE_INTERVAL_S)
def inferencefleet_autoscale(spec, name, namespace, body, status, patch, memo, **_) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig()
    try:
        fleet = parse_fleet(name, namespace, dict(spec))
    except InvalidSpec:
        return
    pods, queued, counts = observe_fleet(fleet, config.redis_url, config.scrape_timeout_s)
    patch.status.update(counts)
    metrics.KV_USAGE.labels(namespace, name).set(counts["kvCacheUsage"])
    metrics.GATEWAY_QUEUED.labels(namespace, name).set(queued)
    if not fleet.autoscaling_enabled:
        return
    states = memo.setdefault("autoscalers", {})
    state: AutoscalerState = states.setdefault(f"{namespace}/{name}", AutoscalerState())
    decision = recommend(Observation(time.monotonic(), fleet.replicas, tuple(pods), queued), fleet.autoscaling, state)
    metrics.DESIRED_REPLICAS.labels(namespace, name).set(decision.desired)
    if decision.desired == fleet.replicas:
        return
    metrics.SCALE_DECISIONS.labels(namespace, name, "up" if decision.desired > fleet.replicas else "down").inc()
    entry = {"time": now_iso(), "from": fleet.replicas, "to": decision.desired, "reason": decision.reason,
             **decision.inputs(), "gatewayQueued": queued}
    client.CustomObjectsApi().patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                             {"spec": {"replicas": decision.desired}})
    patch.status["scalingHistory"] = ([*(status.get("scalingHistory") or []), entry])[-HISTORY:]
    patch.status["lastScaleTime"] = entry["time"]
    patch.status["conditions"] = [condition("Scaling", True, "Scaled", f"{fleet.replicas} -> {decision.desired}: "
                                            f"{decision.reason}")]
    kopf.info(body, reason="Scaled", message=f"{fleet.replicas} -> {decision.desired}: {decision.reason}")
    log.info("fleet %s/%s: %d -> %d replicas (%s)", namespace, name, fleet.replicas, decision.desired,
             decision.reason)
