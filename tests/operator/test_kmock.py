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

import os
import subprocess
import sys
import time

import pytest
from kubernetes import client

from kvfleet.fleet.redis_keys import queue_key
from kvfleet.local.kube_emulator import KubeEmulator
from kvfleet.local.redis_server import RedisServer
from tests.conftest import free_port
from tests.support.kmock import FLEETS, NS, MetricsServer, create_fleet, engine_pod, eventually, replicas
from tests.support.paths import DATA

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    emulator = KubeEmulator().start()
    kubeconfig = emulator.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config.json")
    log = tmp_path_factory.mktemp("op") / "operator.log"
    liveness, metrics_port = free_port(), free_port()
    redis_server = RedisServer().start()
    operator = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "operator", "--metrics-port", str(metrics_port),
         "--redis-url", redis_server.url,
         "--autoscale-interval", "1", "--liveness", f"http://127.0.0.1:{liveness}/healthz"],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    operator.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield emulator.api_client(), operator, log, liveness, redis_server
    operator.terminate()
    operator.wait(timeout=30)
    redis_server.stop()
    emulator.stop()


def scaled_fleet(api_client, name: str) -> dict:
    """The fleet once its status records the scaling decision: the operator writes the record (scalingHistory, the
    autoscaler's state) in a status patch of its own, after the scale itself."""
    def recorded() -> dict | None:
        fleet = client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, name)
        status = fleet.get("status", {})
        return fleet if status.get("scalingHistory") and "autoscaler" in status else None
    return eventually(recorded)


def test_a_fleet_gets_its_deployment_and_service_and_they_follow_and_are_repaired(api) -> None:
    api_client, operator, log, liveness, _ = api
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
    api_client, operator, log, liveness, _ = api
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


def test_high_kv_usage_scales_up_within_a_period_and_low_scales_down_after_the_window(api) -> None:
    api_client, operator, log, liveness, _ = api
    metrics = MetricsServer()
    metrics.kv, metrics.running = 0.95, 10
    create_fleet(api_client, "auto", {
        "model": "smollm2-135m-instruct", "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetKVCacheUsage": 0.7,
                        "scaleDownStabilizationSeconds": 4}})
    core = client.CoreV1Api(api_client)
    for i in range(2):  # two ready pods whose /metrics is the metrics server
        core.create_namespaced_pod(NS, engine_pod("auto", f"auto-engine-{i}", metrics.port))
    eventually(lambda: replicas(api_client, "auto") == 3, timeout=15)  # ceil(2 × 0.95 / 0.7)
    eventually(lambda: client.AppsV1Api(api_client).read_namespaced_deployment("auto-engine", NS)
               .spec.replicas == 3)
    fleet = scaled_fleet(api_client, "auto")
    [entry] = fleet["status"]["scalingHistory"]
    assert (entry["from"], entry["to"]) == (2, 3) and entry["reason"].startswith("up")
    assert entry["kvCacheUsage"] == 0.95 and fleet["status"]["kvCachePercent"] == 95

    metrics.kv, metrics.running = 0.05, 0
    low_since = time.monotonic()
    eventually(lambda: replicas(api_client, "auto") < 3, timeout=20)
    assert time.monotonic() - low_since >= 3.0  # not before the 4 s scale-down window (minus one period)
    import urllib.request

    with urllib.request.urlopen(operator.metrics_url, timeout=5) as r:
        text = r.read().decode()
    assert 'kvfleet_operator_scale_decisions_total{direction="up",fleet="auto",namespace="llm"} 1.0' in text
    assert 'kvfleet_operator_scale_decisions_total{direction="down",fleet="auto",namespace="llm"}' in text


def test_requests_queued_at_the_gateway_scale_a_fleet_from_zero(api) -> None:
    api_client, operator, log, liveness, redis_server = api
    create_fleet(api_client, "zero", {
        "model": "smollm2-135m-instruct", "replicas": 0,
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4}})
    time.sleep(2.5)
    assert replicas(api_client, "zero") == 0  # no demand: stays at zero
    import redis

    r = redis.Redis.from_url(redis_server.url)
    r.zadd(queue_key("zero"), {f"gw-{i}": 1000 + i for i in range(6)})  # what waiting gateways leave there
    eventually(lambda: replicas(api_client, "zero") == 2, timeout=15)  # ceil(6 / 4 per replica)


def test_the_slo_planner_sizes_a_fleet_from_the_gateways_counts_and_the_engines_capacity(api) -> None:
    """Per-class counts in Redis (what the gateways wrote half a minute ago) and pods that report their measured
    capacity: the operator plans in units of work and says so in the status."""
    import redis

    from kvfleet.fleet.priority import Priority
    from kvfleet.fleet.redis_keys import slo_slot_key
    from kvfleet.fleet.slo_stats import ARRIVALS, COMPLETED, OUTPUT_TOKENS, PROMPT_TOKENS, field, slot_start

    api_client, _, _, _, redis_server = api
    metrics = MetricsServer()
    metrics.kv, metrics.running = 0.2, 4
    metrics.extra = "kvfleet_prefill_tokens_per_second 480\nkvfleet_decode_tokens_per_second_full_batch 116\n"
    n = 180  # standard requests of 136 prompt and 64 output tokens: 3 req/s over the minute
    redis.Redis.from_url(redis_server.url).hset(slo_slot_key("planned", slot_start(time.time() - 30)), mapping={
        field(Priority.STANDARD, ARRIVALS): n, field(Priority.STANDARD, PROMPT_TOKENS): 136 * n,
        field(Priority.STANDARD, COMPLETED): n, field(Priority.STANDARD, OUTPUT_TOKENS): 64 * n})
    create_fleet(api_client, "planned", {"model": "smollm2-135m-instruct", "replicas": 1,
                                         "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8}})
    client.CoreV1Api(api_client).create_namespaced_pod(NS, engine_pod("planned", "planned-engine-0", metrics.port))
    # 3 req/s × (136/480 + 64/116) s of a pod each, at 90 % utilization: ceil(2.6-2.8) = 3 pods
    eventually(lambda: replicas(api_client, "planned") == 3, timeout=15)
    fleet = scaled_fleet(api_client, "planned")
    auto = fleet["status"]["autoscaler"]
    assert auto["planner"]["capacity"] == {"prefillTokensPerSecond": 480.0, "decodeTokensPerSecond": 116.0}
    [entry] = fleet["status"]["scalingHistory"]
    # 2.5 pods of work over 60 s; the window reaches back to its oldest 5 s slot's start, 60-65 s: 2.31-2.5
    assert entry["reason"].startswith("up: plan") and 2.3 < entry["plan"]["workPods"]["standard"] < 2.6


def test_a_vllm_fleet_gets_vllm_pods_and_scales_on_vllms_metrics(api) -> None:
    """runtime: vllm: the Deployment runs `vllm serve`; its pods' /metrics (vLLM's names, two data-parallel ranks at
    0.9 and 0.5 KV usage: 0.7 on average) drive the autoscaler as kvfleet engines' do."""
    api_client, *_ = api
    metrics = MetricsServer()
    metrics.raw = (DATA / "vllm-metrics-dp2.txt").read_text().replace(
        'engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5', 'engine="1",model_name="x"} 1.0')
    create_fleet(api_client, "vl", {"model": "meta-llama/Llama-3.1-8B-Instruct", "runtime": "vllm", "replicas": 2,
                                    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6,
                                                    "targetKVCacheUsage": 0.7}})
    deployment = eventually(lambda: client.AppsV1Api(api_client).read_namespaced_deployment("vl-engine", NS))
    [engine] = deployment.spec.template.spec.containers
    assert engine.command == ["vllm", "serve"] and engine.image.startswith("vllm/vllm-openai:")
    core = client.CoreV1Api(api_client)
    for i in range(2):
        core.create_namespaced_pod(NS, engine_pod("vl", f"vl-engine-{i}", metrics.port))
    eventually(lambda: replicas(api_client, "vl") == 3, timeout=15)  # ceil(2 x 0.95 / 0.7): its own pods only
    fleet = scaled_fleet(api_client, "vl")
    assert fleet["status"]["scalingHistory"][0]["kvCacheUsage"] == 0.95
