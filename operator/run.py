"""`kvfleet operator`: runs the kopf handlers as one replica (kopf's peering is off: the chart runs exactly one
operator pod with the Recreate strategy, so no two operators ever act on the same fleet)."""

from __future__ import annotations

import asyncio
import logging
import os

import kopf

from kvfleet.operator.settings import OperatorConfig

log = logging.getLogger("kvfleet.operator")


def load_kubernetes_config() -> None:
    """In a pod: its service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


@kopf.on.startup()
def operator_startup(settings: kopf.OperatorSettings, **_) -> None:
    settings.posting.level = logging.INFO  # scaling decisions become Events
    settings.persistence.finalizer = "kvfleet.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvfleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvfleet.io")
    settings.watching.server_timeout = 300


def run(config: OperatorConfig, namespaces: list[str], liveness: str | None, metrics_port: int | None) -> int:
    os.environ["KVFLEET_AUTOSCALE_INTERVAL"] = str(config.autoscale_interval_s)
    import kvfleet.operator.handlers  # noqa: F401 - registers the handlers

    load_kubernetes_config()
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
    memo = kopf.Memo(config=config)
    asyncio.run(kopf.operator(standalone=True, clusterwide=not namespaces, namespaces=namespaces,
                              liveness_endpoint=liveness, memo=memo))
    return 0
