"""Which Kubernetes pods are engine endpoints, and at what URL: the gateway routes to them, the operator scrapes
them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import V1Pod

ENGINE_PORT_NAME = "http"  # the engine container's port that serves the API and /metrics
DEFAULT_ENGINE_PORT = 8000
FLEET_LABEL = "kvfleet.io/fleet"  # on every engine pod: the InferenceFleet it belongs to (what the gateway selects)
# the InferenceFleet resource: the operator serves it, a gateway fronting several fleets reads it
FLEET_GROUP, FLEET_VERSION, FLEET_PLURAL, FLEET_KIND = "kvfleet.io", "v1alpha1", "inferencefleets", "InferenceFleet"


def pod_endpoint(pod: dict[str, Any] | V1Pod, port_name: str = ENGINE_PORT_NAME) -> str | None:
    """The engine URL of a pod that is Ready, has an IP and is not being deleted; None for any other pod."""
    if not isinstance(pod, dict):
        pod = pod.to_dict(serialize=True)  # the API's camelCase names, like a raw watch event
    conditions = (pod.get("status") or {}).get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return None
    return running_pod_url(pod, port_name)


def running_pod_url(pod: dict[str, Any], port_name: str = ENGINE_PORT_NAME) -> str | None:
    """The engine URL of a pod that has an IP and is not being deleted, Ready or not (an engine asleep in a warm
    pool is not Ready); None for any other pod."""
    metadata = pod.get("metadata") or {}
    ip = (pod.get("status") or {}).get("podIP")
    if metadata.get("deletionTimestamp") or not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip  # IPv6
    return f"http://{host}:{_container_port(pod, port_name)}"


def _container_port(pod: dict[str, Any], port_name: str) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == port_name and port.get("containerPort"):
                return int(port["containerPort"])
    return DEFAULT_ENGINE_PORT
