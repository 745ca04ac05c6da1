"""The engine's settings, declared once: type, default, bounds, help, `kvfleet engine` flag (vLLM's names) and, where
an InferenceFleet exposes one, its spec.engine field. Flags, EngineConfig, command lines and the CRD derive from it."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.fleet.lora import DEFAULT_MAX_LORA_RANK
from kvfleet.fleet.priority import BATCH_ENGINE_PRIORITY

DEFAULT_MODEL = "smollm2-135m-instruct"
# How long a kvfleet server (engine, gateway) and a vLLM engine kvfleet starts (VLLM_HTTP_TIMEOUT_KEEP_ALIVE; vLLM's
# own default is 5 s) keep an idle connection open: longer than every client pool in front of them keeps one (httpx:
# 5 s, the gateway's scrapes: 30 s, Envoy: POOL_IDLE_S), since a server that closes an idle connection just as a
# client reuses it makes that request fail with no answer, and the gateway then retries it on another engine.
KEEP_ALIVE_S = 75
POOL_IDLE_S = KEEP_ALIVE_S - 15  # how long Envoy keeps an idle connection to an engine or the gateway's app
DRAIN_S = 30  # seconds an engine (kvfleet's --drain-timeout, vLLM's --shutdown-timeout) finishes requests on SIGTERM
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # tokens per KV block: the kernels' tiles need a power of two
ENGINE_API_KEY_ENV = "KVFLEET_ENGINE_API_KEY"  # the engines' shared token; never on a command line
DTYPE_ENV = "KVFLEET_DTYPE"  # --dtype's default where set (a container's environment; the test suite pins float32)
# An InferenceFleet's pods get a fixed context length unless its spec says otherwise, so a fleet's KV capacity does
# not change with its model; the engine alone defaults to the model's own length.
FLEET_MAX_MODEL_LEN = 2048
ENGINE_DEFAULT: Any = object()  # a CrdField default: the engine's own default is the schema's


@dataclass(frozen=True)
class CrdField:
    """How an InferenceFleet's spec.engine exposes a setting: its camelCase name and the schema's bounds."""

    name: str
    minimum: float | None = None
    maximum: float | None = None
    default: Any = None  # None: the schema has none and the engine's own applies
    description: str = ""
    enum: tuple | None = None  # the only values the engine takes, when they are not a range


@dataclass(frozen=True)
class Setting:
    """What a field of EngineSettings declares besides its type and default."""

    help: str | None = None
    minimum: int | None = None  # inclusive; EngineConfig checks it
    choices: tuple[str, ...] | None = None
    size: bool = False  # bytes, or a size such as 512MiB or 1Gi
    crd: CrdField | None = None
    flag: bool = True  # False: set in code only, no `kvfleet engine` flag
    env: str | None = None  # the flag's default is read from this environment variable
    secret: bool = False  # kept out of repr and off command lines
    many: bool = False  # a list of strings: one flag followed by its values (vLLM's `--lora-modules a=p b=q`)


def setting(default: Any, **declared: Any) -> Any:
    meta = Setting(**declared)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"setting": meta}, repr=not meta.secret)
    return field(default=default, metadata={"setting": meta}, repr=not meta.secret)


@dataclass
class EngineSettings:
    """What `kvfleet engine` takes; names follow vLLM's flags. EngineConfig adds the engine's checks."""

    model: str = setting(DEFAULT_MODEL,
                         help=f"{DEFAULT_MODEL} (default) or a local HF-format directory of a Llama-family model")
    max_model_len: int | None = setting(None, help="context length (default: the model's)", minimum=1,
                                        crd=CrdField("maxModelLen", 16, 1 << 20, FLEET_MAX_MODEL_LEN))
    max_num_seqs: int = setting(128, help="most sequences in one batch", minimum=1,
                                crd=CrdField("maxNumSeqs", 1, 4096, ENGINE_DEFAULT))
    max_num_batched_tokens: int = setting(2048, help="token budget of one step", minimum=1)
    max_num_waiting: int = setting(1024, help="longest waiting queue before rejecting", minimum=0)
    long_prefill_token_threshold: int = setting(0, minimum=0, help="the most prompt tokens of one request a step "
                                                "computes (vLLM's flag): a long prompt takes several steps, and a "
                                                "prompt of higher priority starts after its current chunk instead of "
                                                "its whole prefill; 0: off")
    block_size: int = setting(16, help="tokens per KV block", minimum=1,
                              crd=CrdField("blockSize", default=ENGINE_DEFAULT, enum=BLOCK_SIZES))
    # Bytes once EngineConfig has read it; CPU default 1 GiB, CUDA sizes from gpu_memory_utilization.
    kv_cache_memory: int | str | None = setting(
        None, help="KV cache size, bytes or e.g. 512MiB, 2GiB (CPU default 1GiB)", size=True,
        crd=CrdField("kvCacheMemory", description="KV cache size on CPU, e.g. 1Gi"))
    gpu_memory_utilization: float = setting(0.9, help="fraction of GPU memory for weights, activations and KV cache",
                                            crd=CrdField("gpuMemoryUtilization", 0.05, 1.0))
    enable_prefix_caching: bool = setting(True, help="share KV blocks between requests with a common prefix")
    kv_events: bool = setting(True, help="stream the prefix cache's block events on /kv_events (gateways route "
                                         "by them)")
    kv_events_sse: bool = setting(True, help="serve the KV events on GET /kv_events (--no-kv-events-sse: only "
                                             "over ZMQ, as a vLLM pod)")
    kv_events_zmq_port: int | None = setting(None, minimum=0, help="also publish the KV events in vLLM's wire "
                                             "format: ZMQ PUB on this port, replay on the next (0: free ports, "
                                             "reported on /kv_event_sources; default: off)")
    dtype: str = setting("auto", help="auto: on a CPU bfloat16 where it has bfloat16 instructions (AVX-512 BF16, AMX), "
                                      "else float32; on a GPU bfloat16, else float16. Default from $KVFLEET_DTYPE",
                         choices=DTYPES, env=DTYPE_ENV)
    device: str = setting("auto", help="auto, cpu or cuda[:N]")
    seed: int = setting(0)
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(False, help="never capture CUDA graphs of decode steps (vLLM's flag; on CUDA with "
                                              "the Triton backend they are captured at start by default)")
    # Multi-LoRA, with vLLM's flags and defaults (engine/lora_registry.py, engine/lora_layers.py).
    enable_lora: bool = setting(False, help="serve LoRA adapters of the base model (PEFT format), batched together")
    lora_modules: list[str] = setting([], many=True, help="adapters served from the start, as NAME=PATH (a directory "
                                      "with adapter_config.json and adapter_model.safetensors); implies "
                                      "--enable-lora")
    max_loras: int = setting(1, minimum=1, help="most distinct adapters in one batch (each holds a slot of stacked "
                                                "weights)")
    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK, minimum=1, help="the largest rank an adapter may have")
    max_cpu_loras: int | None = setting(None, minimum=1, help="adapters kept read in host memory, least recently "
                                        "used evicted first (default: --max-loras); the rest are read again from "
                                        "their directories when needed")
    lora_allowed_dirs: list[str] = setting([], many=True, help="directories POST /v1/load_lora_adapter may load "
                                           "adapters from (default: none, runtime loading off); a path outside "
                                           "them is refused")
    # Off by default: measured beside the Batch API it did not lower the interactive p99 (docs/benchmarks.md)
    background_yield: bool = setting(False, help=f"requests of priority {BATCH_ENGINE_PRIORITY} or more (background: "
                                     "the gateway's Batch API runner sends them so) sit out each step in which a "
                                     "higher-priority request prefills or waits (kvfleet's; measured: no gain in "
                                     "interactive p99 TTFT on CPUs)")
    # vLLM's flag: POST /sleep frees the KV cache of an idle engine, POST /wake_up takes it back
    # (engine/server/sleep_api.py)
    enable_sleep_mode: bool = setting(False, help="serve POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's): "
                                      "an idle engine releases its KV cache and wakes in about a second, for an "
                                      "autoscaler's warm pool")
    # Benchmark baseline: a batch of up to max_num_seqs forms, then runs until its longest member ends.
    static_batching: bool = setting(False, flag=False)
    # The HTTP server's shared token for /v1/* (None: open).
    api_key: str | None = setting(None, env=ENGINE_API_KEY_ENV, secret=True,
                                  help=f"require `Authorization: Bearer <key>` on /v1/* (default: "
                                       f"${ENGINE_API_KEY_ENV}; /health, /ready and /metrics stay open)")

    def to_args(self) -> list[str]:
        """The `kvfleet engine` flags that give these settings: those that differ from the defaults."""
        return engine_args({f.name: getattr(self, f.name) for f in flag_fields()
                            if not declared(f).secret and getattr(self, f.name) != default_of(f)})

    def check_declared_bounds(self) -> None:
        """ValueError naming the first setting below its declared minimum or outside its choices."""
        for f in dataclasses.fields(EngineSettings):
            meta, value = declared(f), getattr(self, f.name)
            if meta.minimum is not None and isinstance(value, int) and value < meta.minimum:
                raise ValueError(f"{f.name} must be >= {meta.minimum}, got {value}")
            if meta.choices is not None and value not in meta.choices:
                raise ValueError(f"{f.name} must be one of {', '.join(meta.choices)}, got {value!r}")


def declared(f: dataclasses.Field) -> Setting:
    return f.metadata["setting"]


def default_of(f: dataclasses.Field) -> Any:
    """A setting's default value (a list setting's: a new empty list)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def flag_fields() -> Iterator[dataclasses.Field]:
    """The settings `kvfleet engine` takes as flags, in declaration (and --help) order."""
    return (f for f in dataclasses.fields(EngineSettings) if declared(f).flag)


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def value_type(f: dataclasses.Field) -> type:
    """The field's type without None: int, float, bool or str (a size field is str | int, a `many` field a list)."""
    if declared(f).many:
        return list
    hint = typing.get_type_hints(EngineSettings)[f.name]
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    return kinds[0] if len(kinds) == 1 else str


def engine_args(values: Mapping[str, Any]) -> list[str]:
    """`kvfleet engine` flags for these settings (name → value), in declaration order; None keeps the default."""
    by_name = {f.name: f for f in flag_fields()}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise ValueError(f"not engine settings with a flag: {', '.join(unknown)}")
    out: list[str] = []
    for name, f in by_name.items():
        value = values.get(name)
        if value is None:
            continue
        if declared(f).secret:
            raise ValueError(f"{name} goes to the engine through ${declared(f).env}, never on a command line")
        if isinstance(value, bool):
            out.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        elif declared(f).many:
            out += [flag_name(f), *map(str, value)] if value else []
        else:
            out += [flag_name(f), str(value)]
    return out


def crd_fields() -> Iterator[tuple[dataclasses.Field, CrdField]]:
    """The settings an InferenceFleet's spec.engine exposes, with their CRD names and bounds."""
    for f in dataclasses.fields(EngineSettings):
        crd = declared(f).crd
        if crd is not None:
            yield f, crd


def fleet_default(name: str) -> Any:
    """A spec.engine field's default as a fleet's pods get it (None: the engine's own applies, unsaid)."""
    f, crd = next((f, crd) for f, crd in crd_fields() if f.name == name)
    return f.default if crd.default is ENGINE_DEFAULT else crd.default


def crd_engine_properties() -> dict[str, dict]:
    """spec.engine's schema properties, one per exposed setting."""
    out: dict[str, dict] = {}
    for f, crd in crd_fields():
        kind = value_type(f)
        schema: dict = ({"x-kubernetes-int-or-string": True} if declared(f).size
                        else {"type": "integer" if kind is int else "number"})
        schema.update({k: v for k, v in (("minimum", crd.minimum), ("maximum", crd.maximum),
                                         ("enum", list(crd.enum) if crd.enum else None),
                                         ("default", fleet_default(f.name)), ("description", crd.description))
                       if v not in (None, "")})
        out[crd.name] = schema
    return out


@dataclass(frozen=True)
class Profile:
    """Engine settings a context deliberately picks over the engine's own defaults."""

    max_num_seqs: int
    max_model_len: int | None = None
    kv_cache_memory: str | None = None


# `kvfleet up`: several engines share one laptop's cores and memory, so each batches fewer, shorter sequences.
LOCAL_FLEET = Profile(max_num_seqs=64, max_model_len=FLEET_MAX_MODEL_LEN, kv_cache_memory="512MiB")
# `kvfleet up --kubernetes`'s default InferenceFleet (kvfleet/local/cluster.py default_fleet): a laptop-sized CPU fleet.
LOCAL_CLUSTER = Profile(max_num_seqs=16, max_model_len=FLEET_MAX_MODEL_LEN, kv_cache_memory="256Mi")
# The gateway benchmarks: engines saturate after a few sequences, so routing and queueing decide what a client sees.
BENCH = Profile(max_num_seqs=4)
