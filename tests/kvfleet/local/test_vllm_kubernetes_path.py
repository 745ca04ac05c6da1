"""An InferenceFleet with `runtime: vllm` on the local Kubernetes path: the real operator builds its vLLM pod spec
(operator/vllm_runtime.py), and the local kubelet runs it with real vLLM (its args, its env with the token from the
Secret, its /health probes). This is what proved the pod spec against a real `vllm serve`: vLLM's CPU build refused
the fleets' default block size of 16, which the operator now leaves to vLLM. Then the e2e scenarios' scaling (the
same functions kind runs, e2e/test_scenarios.py): load scales the vLLM fleet to a second real vLLM pod on vLLM's own
metrics, a vLLM pod deleted under load loses no request (the pod drains), and idle scales the fleet back."""

from __future__ import annotations

import copy
import time

import httpx
import psutil
import pytest
from kubernetes import client

from e2e import conftest as e2e_target
from e2e import test_scenarios as scenarios
from kvfleet.fleet.cpu_features import flags_have_bf16, host_cpu_flags
from kvfleet.fleet.vllm_serve import cpu_dtype_args
from kvfleet.local.cluster import ClusterSpec, LocalCluster
from tests.conftest import free_port
from tests.support.lora_adapters import make_adapter
from tests.support.vllm_engines import ENGINE_ARGS, SERVED, require_vllm

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")

FLEET = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": "chat"},
         "spec": {"model": SERVED, "runtime": "vllm", "replicas": 1,
                  # the dtype `kvfleet up --runtime vllm` picks for this CPU (float32 where vLLM would emulate
                  # bfloat16): the operator cannot know a node's CPU, a fleet's extraArgs say it
                  "engine": {"maxModelLen": 2048, "maxNumSeqs": 4, "kvCacheMemory": "1Gi",
                             "extraArgs": [*ENGINE_ARGS,
                                           *cpu_dtype_args(ENGINE_ARGS, flags_have_bf16(host_cpu_flags()))]},
                  # on, but held at one replica until the scaling scenario lets it grow
                  "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1}}}


def children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def command_line(process: psutil.Process) -> str:
    """Its command line; "" for one that has exited (the pod the deletion scenario removed)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


@pytest.fixture(scope="module")
def cluster(smollm2_dir, tmp_path_factory: pytest.TempPathFactory):
    install = require_vllm()
    # A LoRA adapter the operator loads onto the vLLM pods through vLLM's runtime API (spec.loraAdapters)
    adapters = tmp_path_factory.mktemp("vllm-fleet-adapters")
    make_adapter(smollm2_dir, adapters / "sql", seed=1, rank=4, targets=("q_proj", "v_proj"), std=0.2)
    fleet = copy.deepcopy(FLEET)
    fleet["spec"] |= {"lora": {"path": str(adapters), "maxLoras": 2}, "loraAdapters": [{"name": "sql"}]}
    cluster = LocalCluster(ClusterSpec(fleet, port=free_port(), vllm=str(install.executable), ready_timeout_s=400,
                                       autoscale_interval_s=2.0))
    before = children()  # other tests' processes (the session's vLLM fleet) are not this cluster's
    try:
        cluster.start()
        cluster.others = before
        cluster.processes = [p for p in children() if p not in before]
        yield cluster
    finally:
        cluster.stop()


def test_the_operators_vllm_pod_runs_real_vllm_behind_the_gateway_and_its_token(cluster: LocalCluster) -> None:
    api = cluster.emulator.api_client()
    [pod] = client.CoreV1Api(api).list_namespaced_pod("kvfleet").items
    container = pod.spec.containers[0]
    assert container.command == ["vllm", "serve"] and "--block-size" not in container.args
    # vLLM's own default (0) aborts every request in flight on SIGTERM: the pod drains for the fleet's drainSeconds
    assert container.args[container.args.index("--shutdown-timeout") + 1] == "30"
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


def test_the_operator_loads_the_fleets_adapter_onto_the_vllm_pod_and_the_gateway_routes_it(
        cluster: LocalCluster) -> None:
    api = client.CustomObjectsApi(cluster.emulator.api_client())

    def status() -> dict:
        return api.get_namespaced_custom_object("kvfleet.io", "v1alpha1", "kvfleet", "inferencefleets",
                                                "chat").get("status") or {}

    deadline = time.monotonic() + 60
    while status().get("loraAdaptersReady") != "1/1":
        assert time.monotonic() < deadline, status().get("loraAdapters")
        time.sleep(1)
    [pod] = client.CoreV1Api(cluster.emulator.api_client()).list_namespaced_pod("kvfleet").items
    assert status()["loraAdapters"] == [{"name": "sql", "pods": [pod.metadata.name]}]
    container = pod.spec.containers[0]
    assert "--enable-lora" in container.args
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    base = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={**body, "model": SERVED})
    sql = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={**body, "model": "sql"})
    assert sql.status_code == 200 and sql.json()["model"] == "sql"
    assert sql.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]  # the adapter's own weights
    # vLLM writes its lora_requests_info gauge from a step's stats; once the gateway scrapes it, it reads the
    # engine's /v1/models (every few seconds) and routes and counts `sql` as an adapter's request
    deadline = time.monotonic() + 30
    while 'kvfleet_gateway_lora_requests_total{adapter="sql"}' not in httpx.get(f"{cluster.url}/metrics").text:
        assert time.monotonic() < deadline, "the gateway never took `sql` for vLLM's adapter"
        again = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={**body, "model": "sql"})
        assert again.json()["choices"][0]["text"] == sql.json()["choices"][0]["text"]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def target(cluster: LocalCluster) -> e2e_target.Target:
    # vLLM's new pod is ready 40-80 s after it starts (minutes where an AVX2-only CPU emulates its bfloat16): the
    # scale-up scenario's burst waits that long in the fleet queue, so its clients say they will
    return e2e_target.Target(cluster.url, cluster.spec.namespace, "chat", str(cluster.kubeconfig), SERVED, False,
                             str(cluster.run_dir), max_queue_ms=240_000)


def test_load_on_vllm_scales_the_fleet_to_a_second_vllm_pod(target) -> None:
    scenarios.test_load_raises_kv_usage_and_the_operator_scales_up(target)


def test_deleting_a_vllm_pod_under_load_loses_no_request(target) -> None:
    # the replacement is created; its minute of vLLM start-up is not waited for: the scale-down next removes it
    scenarios.test_deleting_an_engine_pod_under_load_loses_no_request(target, replacement_ready=False)


def test_an_idle_vllm_fleet_scales_back_down(target) -> None:
    scenarios.test_idle_traffic_scales_down(target)


def test_stopping_it_leaves_no_vllm_process_behind(cluster: LocalCluster) -> None:
    cluster.processes += [p for p in children() if p not in cluster.others and p not in cluster.processes]
    assert any("vllm" in command_line(p) for p in cluster.processes)
    cluster.stop()
    assert not [p for p in cluster.processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
