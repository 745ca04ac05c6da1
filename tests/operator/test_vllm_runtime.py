"""`runtime: vllm` in the InferenceFleet: the operator builds vLLM pods (`vllm serve` with the engine fields as its
flags, prefix caching, KV events over ZMQ, probes on vLLM's /health, the token as VLLM_API_KEY, /dev/shm), valid
Kubernetes objects; specs that cannot work are refused naming the field; and a vLLM pod's /metrics (two data-parallel
ranks, by-reason and info series beside the gauges) reads as the load the gateway and the autoscaler act on.
What is not verified here: a vLLM pod running from these manifests (vLLM does not run on these machines)."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from kvfleet.fleet.engine_settings import KEEP_ALIVE_S
from kvfleet.fleet.load import parse_engine_load
from kvfleet.operator.fleet_fields import RUNTIMES
from kvfleet.operator.fleet_spec import InvalidSpec, parse_fleet
from kvfleet.operator.manifests import build_deployment
from kvfleet.operator.vllm_runtime import KV_EVENTS_PORT, VLLM_API_KEY_ENV
from tests.support.paths import DATA

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

GPU_SPEC = {"model": MODEL, "runtime": "vllm", "replicas": 2,
            "engine": {"maxModelLen": 4096, "maxNumSeqs": 128, "blockSize": 16, "gpuMemoryUtilization": 0.9,
                       "extraArgs": ["--dtype", "bfloat16"]},
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}},
            "engineAuth": {"secretName": "engine-token"}}


def container(spec: dict) -> tuple[dict, dict]:
    deployment = build_deployment(parse_fleet("chat", "llm", spec), replicas=2)
    pod = deployment["spec"]["template"]["spec"]
    [engine] = pod["containers"]
    return engine, pod


def test_a_vllm_fleet_runs_vllm_serve_with_the_engine_fields_as_flags() -> None:
    engine, pod = container(GPU_SPEC)
    assert engine["image"] == RUNTIMES["vllm"] and engine["command"] == ["vllm", "serve"]
    args = engine["args"]
    assert args[0] == MODEL and args[-2:] == ["--dtype", "bfloat16"]
    for flag, value in [("--served-model-name", MODEL), ("--port", "8000"), ("--max-model-len", "4096"),
                        ("--max-num-seqs", "128"), ("--block-size", "16"), ("--gpu-memory-utilization", "0.9")]:
        assert args[args.index(flag) + 1] == value, flag
    assert "--enable-prefix-caching" in args
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["endpoint"] == f"tcp://*:{KV_EVENTS_PORT}"
    assert {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"} in engine["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 1800
    token = next(e for e in engine["env"] if e["name"] == VLLM_API_KEY_ENV)
    assert token["valueFrom"]["secretKeyRef"] == {"name": "engine-token", "key": "api-key"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert engine["securityContext"]["readOnlyRootFilesystem"]  # caches go to /tmp (HOME, HF_HOME)
    assert {"name": "HF_HOME", "value": "/tmp/huggingface"} in engine["env"]
    # vLLM keeps an idle connection as long as kvfleet's servers do, past the gateway's pools (its own default: 5 s)
    assert {"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": str(KEEP_ALIVE_S)} in engine["env"]


def test_the_vllm_deployment_is_valid_kubernetes() -> None:
    deployment = build_deployment(parse_fleet("chat", "llm", GPU_SPEC), replicas=2)
    kubernetes_validate.validate(deployment, "1.33.0", strict=True)


def test_kv_cache_memory_on_cpu_becomes_vllms_cpu_cache_size() -> None:
    engine, _ = container({"model": MODEL, "runtime": "vllm", "engine": {"kvCacheMemory": "1536Mi"}})
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"} in engine["env"]  # GiB, rounded up
    assert "--gpu-memory-utilization" not in engine["args"]


def test_an_unsaid_block_size_is_vllms_own_as_real_vllm_on_cpus_refuses_kvfleets_16() -> None:
    """Found against real vLLM (vllm-cpu 0.32.0): the fleets' default block size, 16, stopped its CPU worker with
    "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"."""
    cpu, _ = container({"model": MODEL, "runtime": "vllm"})
    assert "--block-size" not in cpu["args"]
    said, _ = container({"model": MODEL, "runtime": "vllm", "engine": {"blockSize": 64}})
    assert said["args"][said["args"].index("--block-size") + 1] == "64"
    kvfleet, _ = container({"model": MODEL})
    assert kvfleet["args"][kvfleet["args"].index("--block-size") + 1] == "16"


def test_an_image_given_wins_and_the_default_runtime_is_kvfleets() -> None:
    engine, _ = container(GPU_SPEC | {"image": "registry.local/vllm:pinned"})
    assert engine["image"] == "registry.local/vllm:pinned"
    kvfleet, _ = container({"model": "smollm2-135m-instruct"})
    assert kvfleet["image"] == RUNTIMES["kvfleet"] and kvfleet["command"] == ["kvfleet"]


@pytest.mark.parametrize(("spec", "says"), [
    ({"model": MODEL, "runtime": "tgi"}, "spec.runtime must be one of kvfleet, vllm"),
    ({"model": MODEL, "runtime": "vllm", "engine": {"kvCacheMemory": "8Gi"},
      "resources": {"limits": {"nvidia.com/gpu": 1}}}, "gpuMemoryUtilization"),
    ({"model": MODEL, "runtime": "vllm", "engine": {"blockSize": 16}},
     "blockSize 16: vLLM on CPUs takes multiples of 32"),
])
def test_specs_a_vllm_pod_cannot_run_are_refused_naming_the_field(spec: dict, says: str) -> None:
    with pytest.raises(InvalidSpec, match=says):
        parse_fleet("chat", "llm", spec)


def test_a_vllm_pods_metrics_read_as_its_load() -> None:
    """Requests summed over the ranks, KV usage averaged (each rank has its own cache); the by-reason series, which
    shares the waiting gauge's prefix, and the info and histogram series are not counted."""
    load = parse_engine_load((DATA / "vllm-metrics-dp2.txt").read_text())
    assert (load.num_running, load.num_waiting) == (12, 3)
    assert load.kv_cache_usage == pytest.approx(0.7)
    assert load.max_num_seqs is None and load.prefill_tokens_per_second is None  # kvfleet's own gauges only
