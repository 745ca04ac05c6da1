"""An InferenceFleet with `runtime: vllm` on the local Kubernetes path: the real operator builds its vLLM pod spec
(operator/vllm_runtime.py), and the local kubelet runs it with real vLLM (its args, its env with the token from the
Secret, its /health probes). This is what proved the pod spec against a real `vllm serve`: vLLM's CPU build refused
the fleets' default block size of 16, which the operator now leaves to vLLM."""

from __future__ import annotations

import httpx
import psutil
import pytest
from kubernetes import client

from kvfleet.local_cluster import ClusterSpec, LocalCluster
from tests.conftest import free_port
from tests.vllm_engines import ENGINE_ARGS, SERVED, require_vllm

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")

FLEET = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": "chat"},
         "spec": {"model": SERVED, "runtime": "vllm", "replicas": 1,
                  "engine": {"maxModelLen": 2048, "maxNumSeqs": 4, "kvCacheMemory": "1Gi",
                             "extraArgs": list(ENGINE_ARGS)},
                  "autoscaling": {"enabled": False}}}


def children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    install = require_vllm()
    cluster = LocalCluster(ClusterSpec(FLEET, port=free_port(), vllm=str(install.executable), ready_timeout_s=400))
    before = children()  # other tests' processes (the session's vLLM fleet) are not this cluster's
    try:
        cluster.start()
        cluster.processes = [p for p in children() if p not in before]
        yield cluster
    finally:
        cluster.stop()


def test_the_operators_vllm_pod_runs_real_vllm_behind_the_gateway_and_its_token(cluster: LocalCluster) -> None:
    api = cluster.emulator.api_client()
    [pod] = client.CoreV1Api(api).list_namespaced_pod("kvfleet").items
    container = pod.spec.containers[0]
    assert container.command == ["vllm", "serve"] and "--block-size" not in container.args
    assert container.readiness_probe.http_get.path == "/health"
    [token] = [e for e in container.env if e.name == "VLLM_API_KEY"]
    assert token.value is None and token.value_from.secret_key_ref.key == "api-key"
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    answer = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
        "model": SERVED, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4})
    port = container.ports[0].container_port
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert answer.headers["x-kvfleet-engine"].endswith(f":{port}")
    engine = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{engine}/v1/models", timeout=30).status_code == 401  # the token came from the Secret
    assert "vllm:kv_cache_usage_perc" in httpx.get(f"{engine}/metrics", timeout=30).text


def test_stopping_it_leaves_no_vllm_process_behind(cluster: LocalCluster) -> None:
    assert any("vllm" in " ".join(p.cmdline()) for p in cluster.processes)
    cluster.stop()
    assert not [p for p in cluster.processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
