"""`kvfleet operator`: runs the kopf handlers as one replica (kopf's peering is off: the chart runs exactly one
operator pod with the Recreate strategy, so no two operators ever act on the same fleet)."""

from __future__ import annotations

import asyncio
import logging

import kopf

from kvfleet.operator.handlers import register
from kvfleet.operator.settings import OperatorConfig

log = logging.getLogger("kvfleet.operator")


def load_kubernetes_config() -> None:
    """In a pod: its service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.INFO  # scaling decisions become Events
    settings.persistence.finalizer = "kvfleet.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvfleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvfleet.io")
    settings.watching.server_timeout = 300
    return settings


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    """A registry of its own (not kopf's global one): the handlers get the config when they are registered."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(kopf.login_via_client)  # kopf's default login, which only its own has
    register(registry, config)
    return registry


def run(config: OperatorConfig, namespaces: list[str], liveness: str | None, metrics_port: int | None) -> int:
    load_kubernetes_config()
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
    asyncio.run(kopf.operator(registry=build_registry(config), settings=operator_settings(), standalone=True,
                              clusterwide=not namespaces, namespaces=namespaces, liveness_endpoint=liveness))
    return 0
