"""The real kopf operator (`kvfleet operator`, a subprocess) against KMock's Kubernetes API emulator on loopback.

Where KMock differs from a real API server, and what the test does about it:
- it assigns no server-side fields, so test fleets are created with uid, resourceVersion and generation set
  (kopf.adopt needs the uid for owner references);
- it has no garbage collector, so deleting a fleet is checked through the owner references its children carry
  (a real API server then deletes them);
- it rejects kopf's Events (they rely on generateName), which kopf logs and ignores; Events are not asserted;
- with `--namespace`, kopf lists /api/v1/namespaces, which KMock 0.8 cannot serve, so the operator runs
  cluster-wide here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import kmock
import pytest
from kubernetes import client
from kubernetes.client import ApiClient, Configuration

from tests.conftest import free_port

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
NS = "llm"
FLEETS = ("kvfleet.io", "v1alpha1", NS, "inferencefleets")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    box: dict = {}
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
                emulator.resources.load_bundled()
                emulator.resources["kvfleet.io/v1alpha1/inferencefleets"] = {
                    "kind": "InferenceFleet", "namespaced": True, "singular": "inferencefleet",
                    "verbs": ["list", "watch", "get", "patch", "create", "delete", "update"],
                    "subresources": ["status", "scale"]}
                box["url"] = str(server.url).rstrip("/")
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while "url" not in box and time.monotonic() < deadline:
        time.sleep(0.02)
    kubeconfig = tmp_path_factory.mktemp("kube") / "config.json"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": box["url"]}}],
        "users": [{"name": "u", "user": {"token": "test"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    log = tmp_path_factory.mktemp("op") / "operator.log"
    liveness = free_port()
    operator = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "operator", "--metrics-port", "0",
         "--liveness", f"http://127.0.0.1:{liveness}/healthz"],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    config = Configuration(host=box["url"], api_key={"BearerToken": "test"})
    yield ApiClient(config), operator, log, liveness
    operator.terminate()
    operator.wait(timeout=30)
    stop.set()


def eventually(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (client.ApiException, AssertionError, KeyError) as err:
            last = err
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {last}")


def create_fleet(api_client: ApiClient, name: str, spec: dict) -> None:
    body = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "1",
                         "generation": 1}, "spec": spec}
    client.CustomObjectsApi(api_client).create_namespaced_custom_object(*FLEETS, body)


def test_a_fleet_gets_its_deployment_and_service_and_they_follow_and_are_repaired(api) -> None:
    api_client, operator, log, liveness = api
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    create_fleet(api_client, "chat", {"model": "smollm2-135m-instruct", "replicas": 2,
                                      "engine": {"maxNumSeqs": 64}})
    dep = eventually(lambda: apps.read_namespaced_deployment("chat-engine", NS))
    assert dep.spec.replicas == 2
    args = dep.spec.template.spec.containers[0].args
    assert args[args.index("--max-num-seqs") + 1] == "64"
    [owner] = dep.metadata.owner_references
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("InferenceFleet", "chat", "uid-chat", True)
    svc = eventually(lambda: core.read_namespaced_service("chat-engine", NS))
    assert svc.spec.cluster_ip == "None" and svc.metadata.owner_references[0].uid == "uid-chat"

    # The spec changes: the Deployment follows.
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        *FLEETS, "chat", {"spec": {"engine": {"maxNumSeqs": 32}, "replicas": 3}})

    def follows():
        d = apps.read_namespaced_deployment("chat-engine", NS)
        a = d.spec.template.spec.containers[0].args
        return d.spec.replicas == 3 and a[a.index("--max-num-seqs") + 1] == "32"
    eventually(follows)

    # Someone edits the Deployment: it is put back.
    apps.patch_namespaced_deployment("chat-engine", NS, {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "image": "someone/else:latest"}]}}}})
    eventually(lambda: apps.read_namespaced_deployment("chat-engine", NS)
               .spec.template.spec.containers[0].image == "kvfleet/engine:cpu")
    fleet = client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, "chat")
    ready = {c["type"]: c for c in fleet["status"]["conditions"]}["Ready"]
    assert ready["status"] == "True"
    assert operator.poll() is None


def test_an_invalid_spec_gets_a_condition_not_a_crash(api) -> None:
    api_client, operator, log, liveness = api
    create_fleet(api_client, "broken", {"model": "smollm2-135m-instruct", "engine": {"maxNumSeqs": 0}})

    def degraded():
        fleet = client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, "broken")
        conditions = {c["type"]: c for c in fleet["status"]["conditions"]}
        return conditions["Degraded"]["reason"] == "InvalidSpec" and conditions["Degraded"]
    condition = eventually(degraded)
    assert "spec.engine.maxNumSeqs" in condition["message"]
    with pytest.raises(client.ApiException):
        client.AppsV1Api(api_client).read_namespaced_deployment("broken-engine", NS)
    assert operator.poll() is None
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=5) as r:
        assert r.status == 200
