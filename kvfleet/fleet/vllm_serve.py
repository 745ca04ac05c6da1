"""`vllm serve` as kvfleet runs it, one source for the operator's vLLM pods (operator/vllm_runtime.py) and the vLLM
engines started on this machine (kvfleet/local/vllm.py: `kvfleet up --runtime vllm`, the local cluster, the tests
and benches): the model under its served name, prefix caching on, KV events published over ZMQ in vLLM's format for
the gateway's precise index, and the engine settings an InferenceFleet exposes under vLLM's flag names (kvfleet's
engine takes the same names).

vLLM's publisher binds its PUB and replay sockets only for a wildcard host (`tcp://*:PORT`); given an address such as
127.0.0.1 it connects out instead, to a subscriber that must bind. So both are wildcard binds; the gateway reads them
on the engine's /kv_event_sources and dials the engine's own address (gateway/prefix/events_zmq.py). Port 0 binds
both on the address in VLLM_HOST_IP, on ports of the OS's choosing, which /kv_event_sources then reports: how engines
sharing one machine's loopback keep their events off the network (kvfleet/local/vllm.py)."""

from __future__ import annotations

import json
import math

from kvfleet.fleet.engine_settings import DRAIN_S, KEEP_ALIVE_S
from kvfleet.fleet.sizes import parse_size

VLLM_VERSION = "0.32.0"  # the vLLM kvfleet is tested with: the managed install's pin and the pods' default image
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes in multiples of this (its default: 128)
KV_EVENTS_PORT = 5557  # vLLM's default ZMQ endpoint port; the replay socket takes the next
KV_EVENTS_TOPIC = "kv-events"
KV_EVENTS_CONFIG_FLAG = "--kv-events-config"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM checks it on /v1, as kvfleet's engine checks its token
VLLM_KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on CPUs (on GPUs: --gpu-memory-utilization)
VLLM_CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # the cores vLLM's CPU worker binds its threads to
VLLM_HOST_IP_ENV = "VLLM_HOST_IP"  # the address a port-0 KV-event socket binds
VLLM_KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # vLLM's idle keep-alive, seconds (its default 5: shorter than
# the gateway's connection pools keep a connection); kvfleet starts vLLM with KEEP_ALIVE_S, as its own servers
HEALTH_PATH = "/health"  # answers 200 once the model can serve; vLLM has no /ready


def kv_events_config(port: int = KV_EVENTS_PORT) -> str:
    """vLLM's --kv-events-config: PUB on every interface on `port`, its replay socket on the next (port 0: both on
    VLLM_HOST_IP's address, on free ports)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topic": KV_EVENTS_TOPIC,
                       "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1 if port else 0}"},
                      separators=(",", ":"))


def with_kv_events_port(args: list[str], port: int) -> list[str]:
    """The same command line publishing on `port` (0: on free ports of VLLM_HOST_IP's address): a pod's ports,
    moved on a machine where several pods share one address."""
    out = list(args)
    for k, arg in enumerate(out[:-1]):
        if arg == KV_EVENTS_CONFIG_FLAG:
            out[k + 1] = kv_events_config(port)
    return out


SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"  # vLLM's drain on SIGTERM, in seconds
SCHEDULING_POLICY_FLAG = "--scheduling-policy"  # vLLM's queue order: fcfs (its default) or priority


def serve_args(model: str, served_name: str, port: int, *, host: str = "0.0.0.0", events_port: int = KV_EVENTS_PORT,
               max_model_len: int | None = None, max_num_seqs: int | None = None, block_size: int | None = None,
               gpu_memory_utilization: float | None = None, drain_s: int | None = DRAIN_S,
               extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The arguments after `vllm serve`; a setting left None keeps vLLM's own default; `extra` last (vLLM's flags,
    passed through). `drain_s`: on SIGTERM vLLM finishes its requests for this long (vLLM's own default, 0, aborts
    every request in flight with a 500: a pod deleted under load lost requests). The engine orders by the body's
    `priority`, which the gateway sets from each request's class and tenant share (kvfleet.fleet.priority): vLLM's
    default policy, fcfs, ignores it without a word."""
    args = [model, "--served-model-name", served_name, "--host", host, "--port", str(port),
            "--enable-prefix-caching", KV_EVENTS_CONFIG_FLAG, kv_events_config(events_port),
            SCHEDULING_POLICY_FLAG, "priority"]
    for flag, value in (("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs),
                        ("--block-size", block_size), ("--gpu-memory-utilization", gpu_memory_utilization),
                        (SHUTDOWN_TIMEOUT_FLAG, drain_s)):
        if value is not None:
            args += [flag, str(value)]
    return [*args, *extra]


DTYPE_FLAG = "--dtype"
# vLLM on a CPU keeps the model's bfloat16 even where the CPU has no bfloat16 instructions and emulates it: on a 2-core
# AMD EPYC with AVX2 only (2026-12-01, -O0, one engine), 8 streams of 48 tokens decoded 14.5 tok/s in bfloat16 and
# 50.0 in float32 (3.4x); one stream 17.9 and 17.1.
CPU_DTYPE_WITHOUT_BF16 = "float32"


def cpu_dtype_args(extra: tuple[str, ...] | list[str], bf16_instructions: bool | None) -> list[str]:
    """`--dtype float32` for a vLLM on a CPU without bfloat16 instructions, unless `extra` (the user's flags) names
    a dtype; nothing where the CPU has them (vLLM's bfloat16 is then its fast path) or where that is not known."""
    if bf16_instructions is not False or any(a == DTYPE_FLAG or a.startswith(f"{DTYPE_FLAG}=") for a in extra):
        return []
    return [DTYPE_FLAG, CPU_DTYPE_WITHOUT_BF16]


def kv_cache_space_gib(size: str | int) -> str:
    """VLLM_CPU_KVCACHE_SPACE for a KV cache size (vLLM takes whole GiB): rounded up, at least 1."""
    return str(max(1, math.ceil(parse_size(size) / 2**30)))


def serve_env() -> dict[str, str]:
    """The environment every vLLM engine kvfleet starts gets, here or in a pod (beside each one's own)."""
    return {VLLM_KEEP_ALIVE_ENV: str(KEEP_ALIVE_S)}
