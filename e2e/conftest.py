"""Where the scenarios run: a cluster named by the environment (kind, or any cluster with kvfleet installed),
or else a local cluster started here (`kvfleet up --kubernetes`: the real operator and gateway against an
emulated Kubernetes API, engines as local processes), which is how CI on a machine without Docker runs them.

    KVFLEET_E2E_GATEWAY_URL   the gateway's base URL (e.g. a `kubectl port-forward`); unset: start a local cluster
    KVFLEET_E2E_NAMESPACE     the fleet's namespace (default kvfleet)
    KVFLEET_E2E_FLEET         the InferenceFleet's name (default chat)
    KUBECONFIG                the cluster's kubeconfig (the local cluster writes its own)
    KVFLEET_E2E_KIND          set by e2e/kind.sh: scenarios that need a real cluster (helm uninstall) run
    KVFLEET_E2E_GATEWAY_MODE  set by e2e/kind.sh: the chart's gateway.mode (envoy, python, or inferencePool: requests
                              pass another Gateway's Envoy, which adds no x-kvfleet-engine header)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


@dataclass
class Target:
    gateway_url: str
    namespace: str
    fleet: str
    kubeconfig: str | None
    model: str
    on_kind: bool
    logs: str | None = None  # where the local cluster's logs are
    # how long a scenario's client lets its request wait in the fleet queue (x-kvfleet-max-queue-ms); None: the
    # gateway's default (30 s). A runtime whose new pod takes a minute or more to start (vLLM) needs longer for a
    # burst that waits on a scale-up.
    max_queue_ms: int | None = None
    _client: object = field(default=None, init=False, repr=False)

    def api_client(self):
        """One client for the whole session (the kubeconfig is read once)."""
        if self._client is None:
            from kubernetes import config

            self._client = config.new_client_from_config(config_file=self.kubeconfig)
        return self._client


@pytest.fixture(scope="session")
def target():
    url = os.environ.get("KVFLEET_E2E_GATEWAY_URL")
    namespace = os.environ.get("KVFLEET_E2E_NAMESPACE", "kvfleet")
    fleet = os.environ.get("KVFLEET_E2E_FLEET", "chat")
    model = os.environ.get("KVFLEET_E2E_MODEL", "smollm2-135m-instruct")
    if url:
        yield Target(url.rstrip("/"), namespace, fleet, os.environ.get("KUBECONFIG"), model,
                     bool(os.environ.get("KVFLEET_E2E_KIND")))
        return
    from kvfleet.fleet.ports import free_port
    from kvfleet.local.cluster import ClusterSpec, LocalCluster, default_fleet

    cluster = LocalCluster(ClusterSpec(default_fleet(fleet, model), namespace=namespace, port=free_port(),
                                       autoscale_interval_s=2.0))
    try:
        cluster.start()
        yield Target(cluster.url, namespace, fleet, str(cluster.kubeconfig), model, False, str(cluster.run_dir))
    finally:
        cluster.stop()
