"""An InferenceFleet's spec read into plain data, with the checks the CRD schema cannot express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet.engine.config import parse_size
from kvfleet.operator.autoscaler import AutoscalingPolicy

GROUP, VERSION, PLURAL, KIND = "kvfleet.io", "v1alpha1", "inferencefleets", "InferenceFleet"
DEFAULT_IMAGE = "kvfleet/engine:cpu"
ENGINE_PORT = 8000
# The engines' shared token (issue 13): the Secret key and the env var the engine and the gateway read it from.
ENGINE_API_KEY_ENV = "KVFLEET_ENGINE_API_KEY"
ENGINE_API_KEY_SECRET_KEY = "api-key"


class InvalidSpec(ValueError):
    """A spec the operator cannot act on; the message says which field to change."""


@dataclass(frozen=True)
class EngineSettings:
    max_model_len: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float | None = None
    extra_args: tuple[str, ...] = ()

    def args(self, model: str) -> list[str]:
        out = ["engine", "--model", model, "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
               "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
               "--block-size", str(self.block_size)]
        if self.kv_cache_memory:
            out += ["--kv-cache-memory", self.kv_cache_memory]
        if self.gpu_memory_utilization is not None:
            out += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return out + list(self.extra_args)


@dataclass(frozen=True)
class FleetSpec:
    name: str
    namespace: str
    model: str
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    engine: EngineSettings = EngineSettings()
    resources: dict = field(default_factory=dict)
    replicas: int = 1
    autoscaling_enabled: bool = False
    autoscaling: AutoscalingPolicy = AutoscalingPolicy()
    drain_seconds: int = 30
    # A Secret in the fleet's namespace whose `api_key_secret_key` the engines require as a bearer token.
    api_key_secret: str | None = None
    api_key_secret_key: str = ENGINE_API_KEY_SECRET_KEY

    @property
    def gpu(self) -> bool:
        limits = (self.resources or {}).get("limits") or {}
        return any(k.endswith("/gpu") for k in limits)


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


def parse_fleet(name: str, namespace: str, spec: dict[str, Any], default_api_key_secret: str | None = None
                ) -> FleetSpec:
    """The spec as the operator uses it; InvalidSpec names the first field to fix. `default_api_key_secret` is
    the operator's --engine-api-key-secret, for fleets whose spec names none."""
    model = spec.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidSpec("spec.model is required: a known model name (smollm2-135m-instruct) or a path in the image")
    engine = spec.get("engine") or {}
    kv = engine.get("kvCacheMemory")
    if kv is not None:
        try:
            parse_size(str(kv))
        except ValueError:
            raise InvalidSpec(f"spec.engine.kvCacheMemory {kv!r} is not a size; write e.g. 1Gi or 512MiB") from None
    extra = engine.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise InvalidSpec("spec.engine.extraArgs must be a list of strings")
    gpu_util = engine.get("gpuMemoryUtilization")
    settings = EngineSettings(
        max_model_len=_int(engine, "maxModelLen", "spec.engine", 2048, 16, 1 << 20),
        max_num_seqs=_int(engine, "maxNumSeqs", "spec.engine", 128, 1, 4096),
        block_size=_int(engine, "blockSize", "spec.engine", 16, 1, 1024),
        kv_cache_memory=str(kv) if kv is not None else None,
        gpu_memory_utilization=None if gpu_util is None else _float(engine, "gpuMemoryUtilization", "spec.engine",
                                                                     0.9, 0.05, 1.0),
        extra_args=tuple(extra))
    auto = spec.get("autoscaling") or {}
    try:
        policy = AutoscalingPolicy(
            min_replicas=_int(auto, "minReplicas", "spec.autoscaling", 1, 0, 1000),
            max_replicas=_int(auto, "maxReplicas", "spec.autoscaling", 8, 1, 1000),
            target_kv_usage=_float(auto, "targetKVCacheUsage", "spec.autoscaling", 0.7, 0.01, 1.0),
            target_queue_per_replica=_float(auto, "targetQueuePerReplica", "spec.autoscaling", 4.0, 0.1, 1e6),
            tolerance=_float(auto, "tolerance", "spec.autoscaling", 0.1, 0.0, 0.99),
            scale_up_stabilization_s=_float(auto, "scaleUpStabilizationSeconds", "spec.autoscaling", 0, 0, 3600),
            scale_down_stabilization_s=_float(auto, "scaleDownStabilizationSeconds", "spec.autoscaling", 300, 0,
                                              3600),
            scale_to_zero_idle_s=_float(auto, "scaleToZeroAfterSeconds", "spec.autoscaling", 300, 0, 86400))
    except ValueError as err:
        raise InvalidSpec(f"spec.autoscaling: {err}") from None
    resources = spec.get("resources") or {}
    if not isinstance(resources, dict):
        raise InvalidSpec("spec.resources must be a Kubernetes ResourceRequirements object")
    api_key_secret, api_key_secret_key = _engine_auth(spec, default_api_key_secret)
    return FleetSpec(
        name=name, namespace=namespace, model=model.strip(), image=spec.get("image") or DEFAULT_IMAGE,
        image_pull_policy=spec.get("imagePullPolicy") or "IfNotPresent", engine=settings, resources=resources,
        replicas=_int(spec, "replicas", "spec", 1, 0, 1000), autoscaling_enabled=bool(auto.get("enabled", False)),
        autoscaling=policy, drain_seconds=_int(spec, "drainSeconds", "spec", 30, 0, 3600),
        api_key_secret=api_key_secret, api_key_secret_key=api_key_secret_key)
