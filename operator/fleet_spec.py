"""An InferenceFleet's spec read into plain data, with the checks the CRD schema cannot express."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from kvfleet.fleet.engine_settings import (
    ENGINE_API_KEY_ENV,
    crd_fields,
    declared,
    engine_args,
    fleet_default,
    value_type,
)
from kvfleet.fleet.pods import DEFAULT_ENGINE_PORT as ENGINE_PORT
from kvfleet.fleet.pods import FLEET_GROUP, FLEET_KIND, FLEET_PLURAL, FLEET_VERSION
from kvfleet.fleet.priority import PRIORITY_NAMES, Priority
from kvfleet.fleet.sizes import parse_size
from kvfleet.fleet.slo import DEFAULT_SLO_CLASSES, SloClass
from kvfleet.fleet.vllm_serve import VLLM_CPU_BLOCK_MULTIPLE
from kvfleet.operator.autoscaler import AutoscalingPolicy
from kvfleet.operator.fleet_fields import (
    AUTOSCALING_ENABLED,
    AUTOSCALING_FIELDS,
    DEFAULT_IMAGE,
    DEFAULT_RUNTIME,
    RUNTIMES,
    SPEC_FIELDS,
    FleetField,
    spec_default,
)
from kvfleet.operator.lora_spec import FleetLora, InvalidLoraSpec, parse_lora
from kvfleet.operator.planner import Capacity
from kvfleet.operator.warm_pool_spec import InvalidWarmPool, WarmPool, parse_warm_pool

__all__ = ["DEFAULT_IMAGE", "ENGINE_API_KEY_ENV", "ENGINE_PORT", "FleetEngineSettings", "FleetSpec", "InvalidSpec",
           "parse_fleet"]

GROUP, VERSION, PLURAL, KIND = FLEET_GROUP, FLEET_VERSION, FLEET_PLURAL, FLEET_KIND
# The Secret key the engines' shared token (issue 13) is read from by default.
ENGINE_API_KEY_SECRET_KEY = "api-key"


class InvalidSpec(ValueError):
    """A spec the operator cannot act on; the message says which field to change."""


@dataclass(frozen=True)
class FleetEngineSettings:
    """spec.engine: the engine settings an InferenceFleet exposes (kvfleet/fleet/engine_settings.py declares
    their names, defaults and bounds) and extra flags; None leaves the engine's own default."""

    max_model_len: int = fleet_default("max_model_len")
    max_num_seqs: int = fleet_default("max_num_seqs")
    block_size: int | None = fleet_default("block_size")  # None: vLLM's own (runtime vllm, unsaid)
    kv_cache_memory: str | None = fleet_default("kv_cache_memory")
    gpu_memory_utilization: float | None = fleet_default("gpu_memory_utilization")
    extra_args: tuple[str, ...] = ()

    def to_args(self, more: list[str] | tuple[str, ...] = ()) -> list[str]:
        """The `kvfleet engine` flags of these settings, then `more` (the fleet's LoRA flags), extra flags last."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra_args"}
        return [*engine_args(settings), *more, *self.extra_args]


@dataclass(frozen=True)
class FleetSpec:
    name: str
    namespace: str
    model: str
    image: str = DEFAULT_IMAGE
    runtime: str = DEFAULT_RUNTIME  # kvfleet or vllm (operator/vllm_runtime.py)
    image_pull_policy: str = "IfNotPresent"
    engine: FleetEngineSettings = FleetEngineSettings()
    resources: dict = field(default_factory=dict)
    replicas: int = spec_default("replicas")
    autoscaling_enabled: bool = spec_default("autoscaling_enabled")
    autoscaling: AutoscalingPolicy = AutoscalingPolicy()
    drain_seconds: int = spec_default("drain_seconds")
    slo_window_s: int = spec_default("slo_window_s")  # status.sloAttainment's window
    # A Secret in the fleet's namespace whose `api_key_secret_key` the engines require as a bearer token.
    api_key_secret: str | None = None
    api_key_secret_key: str = ENGINE_API_KEY_SECRET_KEY
    lora: FleetLora | None = None  # spec.lora and spec.loraAdapters (operator/lora_spec.py)
    warm_pool: WarmPool | None = None  # spec.autoscaling.warmPool (operator/warm_pool.py)

    @property
    def pods(self) -> int:
        """The Deployment's replicas: the serving ones and the warm pool's."""
        return self.replicas + (self.warm_pool.replicas if self.warm_pool else 0)

    @property
    def gpu(self) -> bool:
        return _has_gpu(self.resources)


def _has_gpu(resources: dict | None) -> bool:
    limits = (resources or {}).get("limits") or {}
    return isinstance(limits, dict) and any(str(k).endswith("/gpu") for k in limits)


def _int(section: dict, key: str, where: str, default: int, low: int, high: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidSpec(f"{where}.{key} must be an integer from {low} to {high}, not {value!r}")
    return value


def _float(section: dict, key: str, where: str, default: float, low: float, high: float) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidSpec(f"{where}.{key} must be a number from {low:g} to {high:g}, not {value!r}")
    return float(value)


def _read(section: dict, f: FleetField, where: str) -> Any:
    """A declared field of `section`, its default when absent; InvalidSpec when out of its bounds."""
    if f.kind == "boolean":
        value = section.get(f.name, f.default)
        if not isinstance(value, bool):  # "false" is a non-empty string: bool() would read it as true
            raise InvalidSpec(f"{where}.{f.name} must be true or false, not {value!r}")
        return value
    read = _float if f.reads_float or f.kind == "number" else _int
    return read(section, f.name, where, f.default, f.minimum, f.maximum)


def _engine(engine: dict) -> FleetEngineSettings:
    """spec.engine, read by the engine settings' declaration (names, bounds, fleet defaults)."""
    values: dict[str, Any] = {}
    for f, crd in crd_fields():
        value = engine.get(crd.name)
        if declared(f).size:
            if value is not None:
                try:
                    parse_size(str(value))
                except ValueError:
                    raise InvalidSpec(f"spec.engine.{crd.name} {value!r} is not a size; write e.g. 1Gi or 512MiB"
                                      ) from None
            values[f.name] = None if value is None else str(value)
        elif value is None and fleet_default(f.name) is None:
            values[f.name] = None  # unsaid: the engine's own default applies
        elif crd.enum:
            values[f.name] = engine.get(crd.name, fleet_default(f.name))
            if isinstance(values[f.name], bool) or values[f.name] not in crd.enum:
                raise InvalidSpec(f"spec.engine.{crd.name} must be one of {', '.join(map(str, crd.enum))}, "
                                  f"not {values[f.name]!r}")
        else:
            read = _int if value_type(f) is int else _float
            values[f.name] = read(engine, crd.name, "spec.engine", fleet_default(f.name), crd.minimum, crd.maximum)
    extra = engine.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise InvalidSpec("spec.engine.extraArgs must be a list of strings")
    return FleetEngineSettings(**values, extra_args=tuple(extra))


SLO_FIELDS = {"ttftSeconds": "ttft_s", "attainment": "attainment", "tpotSeconds": "tpot_s"}


def _slo_classes(auto: dict) -> dict[Priority, SloClass]:
    """spec.autoscaling.sloClasses over DEFAULT_SLO_CLASSES: a class or field left out keeps its default."""
    given = auto.get("sloClasses") or {}
    where = "spec.autoscaling.sloClasses"
    if not isinstance(given, dict):
        raise InvalidSpec(f"{where} must be an object keyed by class ({PRIORITY_NAMES}), not {given!r}")
    unknown = [name for name in given if name not in Priority.__members__.values()]
    if unknown:
        raise InvalidSpec(f"{where}.{unknown[0]} is not a priority class; write {PRIORITY_NAMES}")
    classes = dict(DEFAULT_SLO_CLASSES)
    for name, fields_ in given.items():
        if not isinstance(fields_, dict):
            raise InvalidSpec(f"{where}.{name} must be an object: {{ttftSeconds, attainment, tpotSeconds}}")
        bad = next((k for k in fields_ if k not in SLO_FIELDS), None)
        if bad is not None:
            raise InvalidSpec(f"{where}.{name}.{bad} is not a field; write {', '.join(SLO_FIELDS)}")
        flag = next((k for k, v in fields_.items() if isinstance(v, bool)), None)
        if flag is not None:
            raise InvalidSpec(f"{where}.{name}.{flag} must be a number, not {fields_[flag]!r}")
        default = DEFAULT_SLO_CLASSES[Priority(name)]
        try:
            classes[Priority(name)] = SloClass(**{attr: fields_.get(key, getattr(default, attr))
                                                  for key, attr in SLO_FIELDS.items()})
        except ValueError as err:  # SloClass's message starts with the field's name
            raise InvalidSpec(f"{where}.{name}.{err}") from None
    return classes


# spec.autoscaling.capacity's fields: the Capacity attribute each becomes, and what it means (the CRD's description)
CAPACITY_FIELDS = {
    "prefillTokensPerSecond": ("prefill_tokens_per_s", "prompt tokens per second of one pod"),
    "decodeTokensPerSecond": ("decode_tokens_per_s", "output tokens per second of one pod with a full batch "
                                                     "(maxNumSeqs sequences)"),
}
MAX_TOKENS_PER_S = 1e9


def capacity_spec(capacity: Capacity) -> dict[str, float]:
    """spec.autoscaling.capacity as a fleet writes it (what `kvfleet bench capacity` prints)."""
    return {key: round(getattr(capacity, attr), 1) for key, (attr, _) in CAPACITY_FIELDS.items()}


def _capacity(auto: dict) -> Capacity | None:
    """spec.autoscaling.capacity: one pod's profiled capacity (both rates), or None when left out."""
    given, where = auto.get("capacity"), "spec.autoscaling.capacity"
    if given is None:
        return None
    if not isinstance(given, dict):
        raise InvalidSpec(f"{where} must be an object: {{{', '.join(CAPACITY_FIELDS)}}}, not {given!r:.80}")
    bad = next((k for k in given if k not in CAPACITY_FIELDS), None)
    if bad is not None:
        raise InvalidSpec(f"{where}.{bad} is not a field; write {' and '.join(CAPACITY_FIELDS)}")
    values = {}
    for key, (attr, _) in CAPACITY_FIELDS.items():
        v = given.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= MAX_TOKENS_PER_S:
            raise InvalidSpec(f"{where}.{key} must be one pod's tokens per second, above 0 and at most "
                              f"{MAX_TOKENS_PER_S:g}, not {v!r:.80} (`kvfleet bench capacity` measures it)")
        values[attr] = float(v)
    return Capacity(**values)


def _engine_auth(spec: dict[str, Any], default_secret: str | None) -> tuple[str | None, str]:
    """spec.engineAuth names the token's Secret; without it the operator's --engine-api-key-secret applies,
    and `secretName: ""` turns the token off for this fleet."""
    auth = spec.get("engineAuth")
    if auth is None:
        return default_secret or None, ENGINE_API_KEY_SECRET_KEY
    if not isinstance(auth, dict):
        raise InvalidSpec("spec.engineAuth must be an object: {secretName: <Secret in this namespace>, secretKey}")
    secret, key = auth.get("secretName", default_secret), auth.get("secretKey", ENGINE_API_KEY_SECRET_KEY)
    if secret is not None and not isinstance(secret, str):
        raise InvalidSpec(f"spec.engineAuth.secretName must be a Secret name, not {secret!r}")
    if not isinstance(key, str) or not key:
        raise InvalidSpec(f"spec.engineAuth.secretKey must be a key of that Secret, not {key!r}")
    return secret or None, key


def _section(spec: dict[str, Any], key: str) -> dict:
    """spec.<key>, an object ({} when absent); InvalidSpec when it is something else (a list, a string)."""
    section = spec.get(key) or {}
    if not isinstance(section, dict):
        raise InvalidSpec(f"spec.{key} must be an object of fields, not {type(section).__name__} {section!r:.80}")
    return section


def _vllm_block_size(settings: FleetEngineSettings, said: bool, gpu: bool) -> FleetEngineSettings:
    """vLLM picks its block size per platform (16 on GPUs; 128 on CPUs, whose attention takes multiples of 32): the
    fleets' default of 16 is kvfleet's engine's, and vLLM's CPU build refuses it ("No common block size for 16"),
    so an unsaid blockSize is left to vLLM, and a said one it would refuse is refused here."""
    if not said:
        return dataclasses.replace(settings, block_size=None)
    if not gpu and settings.block_size % VLLM_CPU_BLOCK_MULTIPLE:
        raise InvalidSpec(f"spec.engine.blockSize {settings.block_size}: vLLM on CPUs takes multiples of "
                          f"{VLLM_CPU_BLOCK_MULTIPLE} (its default, 128, when blockSize is left out)")
    return settings


def parse_fleet(name: str, namespace: str, spec: dict[str, Any], default_api_key_secret: str | None = None
                ) -> FleetSpec:
    """The spec as the operator uses it; InvalidSpec names the first field to fix. `default_api_key_secret` is
    the operator's --engine-api-key-secret, for fleets whose spec names none."""
    model = spec.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidSpec("spec.model is required: a known model name (smollm2-135m-instruct) or a path in the image")
    settings = _engine(_section(spec, "engine"))
    auto = _section(spec, "autoscaling")
    slo, capacity = _slo_classes(auto), _capacity(auto)
    try:
        policy = AutoscalingPolicy(**{f.attr: _read(auto, f, "spec.autoscaling") for f in AUTOSCALING_FIELDS},
                                   slo=slo, capacity=capacity)
    except ValueError as err:  # an InvalidSpec of a field too, as before: the message gains the prefix
        raise InvalidSpec(f"spec.autoscaling: {err}") from None
    resources = spec.get("resources") or {}
    if not isinstance(resources, dict):
        raise InvalidSpec("spec.resources must be a Kubernetes ResourceRequirements object")
    api_key_secret, api_key_secret_key = _engine_auth(spec, default_api_key_secret)
    runtime = spec.get("runtime") or DEFAULT_RUNTIME
    if runtime not in RUNTIMES:
        raise InvalidSpec(f"spec.runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
    if runtime == "vllm" and settings.kv_cache_memory is not None and _has_gpu(resources):
        raise InvalidSpec("spec.engine.kvCacheMemory: vLLM sizes its KV cache on GPUs from gpuMemoryUtilization; "
                          "remove kvCacheMemory and set engine.gpuMemoryUtilization (e.g. 0.9)")
    if runtime == "vllm":
        settings = _vllm_block_size(settings, "blockSize" in _section(spec, "engine"), _has_gpu(resources))
    try:
        lora = parse_lora(spec, runtime, (model.strip(),))
        warm_pool = parse_warm_pool(auto, runtime)
    except (InvalidLoraSpec, InvalidWarmPool) as err:
        raise InvalidSpec(str(err)) from None
    return FleetSpec(
        name=name, namespace=namespace, model=model.strip(), image=spec.get("image") or RUNTIMES[runtime],
        runtime=runtime,
        image_pull_policy=spec.get("imagePullPolicy") or "IfNotPresent", engine=settings, resources=resources,
        autoscaling_enabled=_read(auto, AUTOSCALING_ENABLED, "spec.autoscaling"), autoscaling=policy,
        api_key_secret=api_key_secret, api_key_secret_key=api_key_secret_key, lora=lora, warm_pool=warm_pool,
        **{f.attr: _read(spec, f, "spec") for f in SPEC_FIELDS})
