"""`kvfleet up --kubernetes`: the operator and the gateway against an emulated API, engines as local processes.

The e2e scenarios (e2e/) drive a whole local cluster; here: the local kubelet's decisions, a bad manifest
refused before anything starts, and a cluster that, once stopped, leaves no process and no listener behind.
"""

from __future__ import annotations

import socket
import sys

import httpx
import psutil
import pytest
from kubernetes import client

from kvfleet.local_cluster import ClusterSpec, LocalCluster, default_fleet
from kvfleet.local_kubelet import PodProcess, local_command, pods_to_stop
from tests.conftest import free_port

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def pod(name: str, ready: bool) -> PodProcess:
    return PodProcess(name, "chat-engine", None, 0, None, ready)  # type: ignore[arg-type]


def test_a_replicaset_stops_not_ready_pods_first_then_the_newest() -> None:
    pods = [pod("a", True), pod("b", False), pod("c", True), pod("d", True)]
    assert [p.name for p in pods_to_stop(pods, 2)] == ["b", "d"]
    assert pods_to_stop(pods, 4) == [] and pods_to_stop(pods, 9) == []
    assert [p.name for p in pods_to_stop(pods, 0)] == ["b", "d", "c", "a"]


def test_the_container_command_runs_here_on_loopback() -> None:
    container = {"command": ["kvfleet"], "args": ["engine", "--model", "m", "--host", "0.0.0.0", "--port", "8000",
                                                  "--max-num-seqs", "8"]}
    assert local_command(container, 4321) == [sys.executable, "-m", "kvfleet.cli", "engine", "--model", "m",
                                              "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", "4321"]


@pytest.mark.parametrize(("change", "message"), [
    ({"model": ""}, "spec.model is required"),
    ({"engine": {"kvCacheMemory": "lots"}}, "kvCacheMemory"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas"),
])
def test_a_bad_fleet_manifest_is_refused_before_anything_starts(change: dict, message: str) -> None:
    manifest = default_fleet()
    manifest["spec"] = {**manifest["spec"], **change}
    cluster = LocalCluster(ClusterSpec(manifest, port=free_port()))
    with pytest.raises(ValueError, match=message):
        cluster.start()
    assert cluster.emulator is None and cluster.operator is None


def test_the_kubernetes_path_serves_and_stopping_it_leaves_nothing_behind(smollm2_dir) -> None:
    port = free_port()
    cluster = LocalCluster(ClusterSpec(default_fleet("chat", max_replicas=1), port=port, autoscale_interval_s=2))
    try:
        cluster.start()
        api = cluster.emulator.api_client()
        dep = client.AppsV1Api(api).read_namespaced_deployment("chat-engine", "kvfleet")
        assert dep.spec.replicas == 1 and dep.metadata.owner_references[0].kind == "InferenceFleet"
        [engine_pod] = client.CoreV1Api(api).list_namespaced_pod("kvfleet").items
        assert engine_pod.status.pod_ip == "127.0.0.1" and engine_pod.metadata.labels["kvfleet.io/fleet"] == "chat"
        answer = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                            json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
        assert answer.status_code == 200 and answer.headers["x-kvfleet-engine"].endswith(
            str(engine_pod.spec.containers[0].ports[0].container_port))
        children = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
        assert len(children) >= 4  # redis-server, the operator, the gateway, an engine
    finally:
        cluster.stop()
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more (a bind test would trip on
        socket.create_connection(("127.0.0.1", port), timeout=2)  # the closed connections' TIME_WAIT)
