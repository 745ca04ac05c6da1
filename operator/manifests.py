"""The children of an InferenceFleet, built as plain dicts from its spec (pure; the handlers apply them)."""

from __future__ import annotations

from kvfleet.fleet.pods import ENGINE_PORT_NAME, FLEET_LABEL
from kvfleet.operator.fleet_spec import ENGINE_API_KEY_ENV, ENGINE_PORT, FleetSpec
from kvfleet.operator.vllm_runtime import vllm_container, vllm_volumes

FIELD_MANAGER = "kvfleet-operator"


def engine_labels(fleet: str) -> dict[str, str]:
    """The labels of ARCHITECTURE.md; the gateway's Kubernetes discovery selects on kvfleet.io/fleet."""
    return {"app.kubernetes.io/name": "kvfleet-engine", "app.kubernetes.io/instance": fleet,
            "app.kubernetes.io/managed-by": FIELD_MANAGER, FLEET_LABEL: fleet}


def selector_labels(fleet: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvfleet-engine", FLEET_LABEL: fleet}


def selector_string(fleet: str) -> str:
    """The label selector of a fleet's engine pods, as the API and the scale subresource take it."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(fleet).items())


def deployment_name(fleet: str) -> str:
    return f"{fleet}-engine"


def service_name(fleet: str) -> str:
    return f"{fleet}-engine"


def _probe(path: str, period: int, failures: int, initial: int = 0) -> dict:
    return {"httpGet": {"path": path, "port": ENGINE_PORT_NAME}, "periodSeconds": period, "failureThreshold": failures,
            "initialDelaySeconds": initial, "timeoutSeconds": 2}


def build_engine_env(fleet: FleetSpec) -> list[dict]:
    """HOME on the writable emptyDir, the fleet's name, and the shared token from its Secret (never inline)."""
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "KVFLEET_FLEET", "value": fleet.name}]
    if fleet.api_key_secret:
        # Not optional: a missing Secret keeps the pod from starting rather than serving without the token.
        env.append({"name": ENGINE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": fleet.api_key_secret, "key": fleet.api_key_secret_key}}})
    return env


def build_engine_container(fleet: FleetSpec) -> dict:
    """kvfleet's engine, or (runtime vllm) a vLLM server built on the same container (vllm_runtime.py)."""
    resources = fleet.resources or {"requests": {"cpu": "1", "memory": "2Gi"},
                                    "limits": {"cpu": "2", "memory": "4Gi"}}
    container = {
        "name": "engine",
        "image": fleet.image,
        "imagePullPolicy": fleet.image_pull_policy,
        "command": ["kvfleet"],
        "args": ["engine", "--model", fleet.model, "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
                 *fleet.engine.to_args(fleet.lora.engine_args(fleet.runtime) if fleet.lora else ()),
                 "--served-model-name", fleet.model,
                 "--drain-timeout", str(fleet.drain_seconds),
                 *(["--enable-sleep-mode"] if fleet.warm_pool else [])],
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": resources,
        # The model loads before /ready turns true; a startup probe gives it minutes without a liveness kill.
        "startupProbe": _probe("/health", 5, 120),
        "readinessProbe": _probe("/ready", 2, 2),
        "livenessProbe": _probe("/health", 10, 3),
        # The endpoints controller needs a moment to drop the pod before the engine stops taking requests.
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "env": build_engine_env(fleet),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *(fleet.lora.mounts() if fleet.lora else [])],
    }
    return vllm_container(fleet, container) if fleet.runtime == "vllm" else container


def build_deployment(fleet: FleetSpec, replicas: int) -> dict:
    """The engine Deployment; `replicas` comes from the fleet (spec or the autoscaler's last decision)."""
    pod_spec: dict = {
        "containers": [build_engine_container(fleet)],
        "terminationGracePeriodSeconds": fleet.drain_seconds + 15,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "tmp", "emptyDir": {}}, *(vllm_volumes() if fleet.runtime == "vllm" else []),
                    *(fleet.lora.volumes() if fleet.lora else [])],
    }
    if fleet.gpu:
        pod_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment_name(fleet.name), "namespace": fleet.namespace,
                     "labels": engine_labels(fleet.name)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(fleet.name)},
            # asleep pods of the warm pool are not Ready: allowed unavailable, or a rollout could never finish
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxUnavailable": fleet.warm_pool.replicas if fleet.warm_pool else 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": engine_labels(fleet.name),
                                      "annotations": {"prometheus.io/scrape": "true",
                                                      "prometheus.io/port": str(ENGINE_PORT)}},
                         "spec": pod_spec},
        },
    }


def build_service(fleet: FleetSpec) -> dict:
    """Headless: the gateway discovers and addresses each ready pod itself."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(fleet.name), "namespace": fleet.namespace,
                     "labels": engine_labels(fleet.name)},
        "spec": {"clusterIP": "None", "selector": selector_labels(fleet.name),
                 "ports": [{"name": ENGINE_PORT_NAME, "port": ENGINE_PORT, "targetPort": ENGINE_PORT_NAME,
                            "protocol": "TCP"}],
                 "publishNotReadyAddresses": False},
    }


def drifted(desired: dict, actual: dict) -> list[str]:
    """The paths where `actual` differs from what we set in `desired` (fields we do not set are ignored, so
    defaults the API server adds are not drift)."""
    out: list[str] = []

    def walk(d, a, path: str) -> None:
        if isinstance(d, dict):
            if not isinstance(a, dict):
                out.append(path or "/")
                return
            for k, v in d.items():
                walk(v, a.get(k), f"{path}.{k}" if path else k)
        elif isinstance(d, list):
            if not isinstance(a, list) or len(a) != len(d):
                out.append(path)
                return
            for i, (dv, av) in enumerate(zip(d, a, strict=True)):
                walk(dv, av, f"{path}[{i}]")
        elif d != a and not (isinstance(d, int | float) and isinstance(a, str) and str(d) == a):
            out.append(path)

    walk(desired, actual, "")
    return out
