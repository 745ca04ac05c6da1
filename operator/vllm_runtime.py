"""`runtime: vllm`: the engine container as a vLLM pod (pure). The InferenceFleet's engine fields become `vllm serve`
flags of the same names (--max-model-len, --max-num-seqs, --block-size, --gpu-memory-utilization), prefix caching is
on, and KV events are published over ZMQ in vLLM's format, which the gateway's precise index follows (discovered on
/kv_event_sources, as for any vLLM pod). Probes use vLLM's /health, which answers once the model can serve; the
gateway and the autoscaler read vLLM's metric names (kvfleet/fleet/metrics.py). The engines' shared token becomes
VLLM_API_KEY, which vLLM checks on /v1 as kvfleet's engine does. On CPUs kvCacheMemory becomes VLLM_CPU_KVCACHE_SPACE
(GiB); on GPUs vLLM sizes the cache from gpuMemoryUtilization (the spec parser refuses kvCacheMemory there).

Verified here: the manifests (built, schema-validated, applied by the operator against the emulated API). Not
verified here: a vLLM pod running from them (vLLM does not run on these machines)."""

from __future__ import annotations

from kvfleet.fleet.pods import ENGINE_PORT_NAME
from kvfleet.fleet.vllm_serve import (
    HEALTH_PATH,
    KV_EVENTS_PORT,
    VLLM_API_KEY_ENV,
    VLLM_KV_CACHE_SPACE_ENV,
    kv_cache_space_gib,
    serve_args,
    serve_env,
)
from kvfleet.operator.fleet_spec import ENGINE_PORT, FleetSpec
from kvfleet.operator.lora_spec import VLLM_RUNTIME_LORA_ENV

STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 180  # 30 minutes: large models download and load slowly


def vllm_args(fleet: FleetSpec) -> list[str]:
    engine = fleet.engine
    return serve_args(fleet.model, fleet.model, ENGINE_PORT, max_model_len=engine.max_model_len,
                      max_num_seqs=engine.max_num_seqs, block_size=engine.block_size,
                      gpu_memory_utilization=engine.gpu_memory_utilization, drain_s=fleet.drain_seconds,
                      extra=(*(fleet.lora.engine_args("vllm") if fleet.lora else ()), *engine.extra_args))


def vllm_env(fleet: FleetSpec) -> list[dict]:
    """Caches on the writable emptyDir (the root filesystem is read-only), the token, the CPU backend's KV size."""
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"},
           {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"}, {"name": "KVFLEET_FLEET", "value": fleet.name},
           *({"name": name, "value": value} for name, value in serve_env().items())]
    if fleet.api_key_secret:
        env.append({"name": VLLM_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": fleet.api_key_secret, "key": fleet.api_key_secret_key}}})
    if fleet.lora:  # the operator loads the fleet's adapters through vLLM's runtime API
        env.append({"name": VLLM_RUNTIME_LORA_ENV, "value": "True"})
    if fleet.engine.kv_cache_memory is not None and not fleet.gpu:
        env.append({"name": VLLM_KV_CACHE_SPACE_ENV, "value": kv_cache_space_gib(fleet.engine.kv_cache_memory)})
    return env


def vllm_container(fleet: FleetSpec, base: dict) -> dict:
    """`base` (kvfleet's engine container: resources, security, lifecycle, mounts) turned into a vLLM server."""
    health = {"httpGet": {"path": HEALTH_PATH, "port": ENGINE_PORT_NAME}, "timeoutSeconds": 2}
    return base | {
        "command": ["vllm", "serve"],
        "args": vllm_args(fleet),
        "ports": [*base["ports"], {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                  {"name": "kv-replay", "containerPort": KV_EVENTS_PORT + 1, "protocol": "TCP"}],
        "startupProbe": health | {"periodSeconds": STARTUP_PERIOD_S, "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": health | {"periodSeconds": 2, "failureThreshold": 2},  # vLLM has no /ready
        "livenessProbe": health | {"periodSeconds": 10, "failureThreshold": 3},
        "env": vllm_env(fleet),
        "volumeMounts": [*base["volumeMounts"], {"name": "dshm", "mountPath": "/dev/shm"}],
    }


def vllm_volumes() -> list[dict]:
    """PyTorch's shared memory between vLLM's processes: the container runtime's 64 MiB default is too small."""
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
