"""An InferenceFleet's LoRA adapters as fleet resources (pure): spec.lora (the adapter store every engine pod mounts,
and the engines' LoRA limits) and spec.loraAdapters (the adapters every pod serves, each a directory in the store).

Adding or removing an adapter changes no pod template: the engines start with LoRA on and the store mounted, and the
operator loads and unloads adapters on each ready pod through the engines' runtime API (operator/lora_sync.py), so
a live fleet changes its adapters without a restart. The store is any one Kubernetes volume: a PersistentVolumeClaim,
an image volume (an OCI image of adapter directories), a ConfigMap (its keys mapped onto `<adapter>/<file>` paths
with `items`), NFS, CSI or a hostPath; or no volume, and `path` names a directory of adapters inside the engine image.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvfleet.fleet.lora import (
    ADAPTER_NAME,
    ADAPTER_NAME_RULE,
    DEFAULT_MAX_LORA_RANK,
    MAX_LORAS_DEFAULT,
    VLLM_MAX_LORA_RANKS,
    max_lora_rank_for,
    valid_adapter_name,
)

STORE_MOUNT = "/var/lib/kvfleet/lora"  # where every engine container mounts spec.lora.store (unless path says)
STORE_VOLUME = "lora-store"
STORE_KINDS = ("persistentVolumeClaim", "image", "configMap", "nfs", "csi", "hostPath")
MAX_FLEET_ADAPTERS = 256
MAX_LORAS_LIMIT = 64  # adapters in one batch: each is a slot of stacked weights in every layer
# A path in the store: segments that do not start with a dot, so no `..`, no `.`, no hidden directory
STORE_PATH = r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$"
ROOT_PATH = r"^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$"  # spec.lora.path: absolute, the same rule for each part
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM serves /v1/load_lora_adapter only with it


class InvalidLoraSpec(ValueError):
    """spec.lora or spec.loraAdapters cannot be served; the message names the field."""


@dataclass(frozen=True)
class FleetAdapter:
    """One entry of spec.loraAdapters."""

    name: str
    path: str  # inside the store
    rank: int | None = None  # as declared; the engine checks the adapter's own on loading
    pinned: bool = False  # kvfleet engines keep its weights in host memory, never evicted


@dataclass(frozen=True)
class FleetLora:
    store: dict | None  # a volume source, e.g. {"persistentVolumeClaim": {"claimName": "adapters"}}; None: in the image
    root: str = STORE_MOUNT  # the directory of adapter directories in the engine container
    adapters: tuple[FleetAdapter, ...] = ()
    max_loras: int = MAX_LORAS_DEFAULT
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None  # None: the engine's default (max_loras)

    def engine_args(self, runtime: str) -> list[str]:
        """The engine flags (vLLM's names, which kvfleet's engine shares); kvfleet's engine also takes loads only
        from the store."""
        args = ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
        if self.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(self.max_cpu_loras)]
        if runtime == "kvfleet":
            args += ["--lora-allowed-dirs", self.root]
        return args

    def path_of(self, adapter: FleetAdapter) -> str:
        """The adapter's directory in the engine container."""
        return f"{self.root}/{adapter.path}"

    def volumes(self) -> list[dict]:
        return [] if self.store is None else [{"name": STORE_VOLUME, **self.store}]

    def mounts(self) -> list[dict]:
        return [] if self.store is None else [{"name": STORE_VOLUME, "mountPath": self.root, "readOnly": True}]


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidLoraSpec(f"{where} must be a whole number from {low} to {high}, not {value!r:.80}")
    return value


def _store(lora: dict) -> dict | None:
    store = lora.get("store")
    if store is None:
        return None
    kinds = list(store) if isinstance(store, dict) else []
    if len(kinds) != 1 or kinds[0] not in STORE_KINDS or not isinstance(store[kinds[0]], dict):
        raise InvalidLoraSpec("spec.lora.store must be one volume source, the directory of adapter directories "
                              f"every engine mounts at {STORE_MOUNT}: one of {', '.join(STORE_KINDS)} (e.g. "
                              f"persistentVolumeClaim: {{claimName: adapters}}), not {store!r:.120}")
    return store


def _adapter(entry: Any, k: int, max_rank: int | None) -> FleetAdapter:
    where = f"spec.loraAdapters[{k}]"
    if not isinstance(entry, dict):
        raise InvalidLoraSpec(f"{where} must be an object: {{name, path, rank, pinned}}, not {entry!r:.80}")
    unknown = next((key for key in entry if key not in ("name", "path", "rank", "pinned")), None)
    if unknown is not None:
        raise InvalidLoraSpec(f"{where}.{unknown} is not a field; write name, path, rank, pinned")
    name = entry.get("name")
    if not valid_adapter_name(name):
        raise InvalidLoraSpec(f"{where}.name must be {ADAPTER_NAME_RULE}, not {name!r:.80}")
    path = entry.get("path", name)
    if not isinstance(path, str) or not re.match(STORE_PATH, path) or len(path) > 1024:
        raise InvalidLoraSpec(f"{where}.path must be a relative path in the store whose parts do not start with "
                              f"a dot (no `..`), not {path!r:.120}")
    rank = entry.get("rank")
    if rank is not None:
        rank = _int(rank, f"{where}.rank", 1, max_rank or VLLM_MAX_LORA_RANKS[-1])
    pinned = entry.get("pinned", False)
    if not isinstance(pinned, bool):
        raise InvalidLoraSpec(f"{where}.pinned must be true or false, not {pinned!r:.80}")
    return FleetAdapter(name, path, rank, pinned)


def parse_lora(spec: dict[str, Any], runtime: str, base_names: tuple[str, ...] = ()) -> FleetLora | None:
    """spec.lora and spec.loraAdapters; None when the fleet serves no adapters. `base_names`: the model's names,
    which no adapter may take."""
    lora, entries = spec.get("lora"), spec.get("loraAdapters")
    if lora is None and not entries:
        return None
    if lora is None:
        raise InvalidLoraSpec("spec.loraAdapters needs spec.lora: a store (the volume the adapters' directories are "
                              "in) or a path (their directory in the engine image)")
    if not isinstance(lora, dict):
        raise InvalidLoraSpec(f"spec.lora must be an object: {{store, maxLoras, maxLoraRank, maxCpuLoras}}, "
                              f"not {lora!r:.80}")
    entries = entries or []
    if not isinstance(entries, list) or len(entries) > MAX_FLEET_ADAPTERS:
        raise InvalidLoraSpec(f"spec.loraAdapters must be a list of at most {MAX_FLEET_ADAPTERS} adapters")
    said_rank = lora.get("maxLoraRank")
    max_rank = None if said_rank is None else _int(said_rank, "spec.lora.maxLoraRank", 1, VLLM_MAX_LORA_RANKS[-1])
    adapters = tuple(_adapter(entry, k, max_rank) for k, entry in enumerate(entries))
    names = [a.name for a in adapters]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise InvalidLoraSpec(f"spec.loraAdapters names {twice!r} twice; each adapter needs its own name")
    taken = next((n for n in names if n in base_names), None)
    if taken is not None:
        raise InvalidLoraSpec(f"spec.loraAdapters: {taken!r} is the base model's name; give the adapter another")
    if max_rank is None:
        max_rank = max_lora_rank_for([a.rank for a in adapters if a.rank is not None])
    elif runtime == "vllm" and max_rank not in VLLM_MAX_LORA_RANKS:
        raise InvalidLoraSpec(f"spec.lora.maxLoraRank {max_rank}: vLLM takes one of "
                              f"{', '.join(map(str, VLLM_MAX_LORA_RANKS))}")
    max_loras = _int(lora.get("maxLoras", MAX_LORAS_DEFAULT), "spec.lora.maxLoras", 1, MAX_LORAS_LIMIT)
    max_cpu = lora.get("maxCpuLoras")
    max_cpu = None if max_cpu is None else _int(max_cpu, "spec.lora.maxCpuLoras", max_loras, 4096)
    pinned = sum(a.pinned for a in adapters)
    if pinned > (max_cpu or max_loras):
        raise InvalidLoraSpec(f"spec.loraAdapters pins {pinned} adapters, more than the engines keep in host "
                              f"memory (spec.lora.maxCpuLoras, default maxLoras: {max_cpu or max_loras}); raise "
                              "maxCpuLoras or pin fewer")
    store, root = _store(lora), lora.get("path", STORE_MOUNT)
    if store is None and "path" not in lora:
        raise InvalidLoraSpec("spec.lora needs a store (a volume of adapter directories, mounted at "
                              f"{STORE_MOUNT}) or a path (a directory of adapters in the engine image)")
    if not isinstance(root, str) or not re.match(ROOT_PATH, root) or len(root) > 1024:
        raise InvalidLoraSpec(f"spec.lora.path must be an absolute directory whose parts do not start with a dot, "
                              f"not {root!r:.120}")
    return FleetLora(store, root, adapters, max_loras, max_rank, max_cpu)


def lora_schemas() -> dict[str, dict]:
    """spec.lora and spec.loraAdapters in the CRD (the parser above checks the same, and what CEL cannot see)."""
    store = {"type": "object", "minProperties": 1, "maxProperties": 1, "x-kubernetes-preserve-unknown-fields": True,
             "description": f"one volume source ({', '.join(STORE_KINDS)}), mounted read-only at {STORE_MOUNT} in "
                            "every engine pod: a directory of adapter directories (adapter_config.json + "
                            "adapter_model.safetensors, PEFT's format)"}
    lora = {"type": "object",
            "description": "LoRA adapters of the model: engines start with LoRA on and the store mounted; adding or "
                           "removing an adapter in loraAdapters loads or unloads it on every pod without a restart",
            "x-kubernetes-validations": [{"rule": "has(self.store) || has(self.path)",
                                          "message": "spec.lora needs a store (a volume) or a path (in the image)"}],
            "properties": {
                "store": store,
                "path": {"type": "string", "pattern": ROOT_PATH, "maxLength": 1024,
                         "description": f"the directory of adapter directories in the engine container: where the "
                                        f"store is mounted (default {STORE_MOUNT}), or, without a store, adapters "
                                        "inside the engine image"},
                "maxLoras": {"type": "integer", "minimum": 1, "maximum": MAX_LORAS_LIMIT, "default": MAX_LORAS_DEFAULT,
                             "description": "distinct adapters in one batch (vLLM's --max-loras)"},
                "maxLoraRank": {"type": "integer", "minimum": 1, "maximum": VLLM_MAX_LORA_RANKS[-1],
                                "description": "the largest rank an adapter may have (default: the smallest of "
                                               f"vLLM's values that fits the adapters' ranks, at least "
                                               f"{DEFAULT_MAX_LORA_RANK})"},
                "maxCpuLoras": {"type": "integer", "minimum": 1, "maximum": 4096,
                                "description": "adapters each engine keeps read in host memory (default maxLoras)"},
            }}
    adapter = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": ADAPTER_NAME, "maxLength": 128,
                 "description": "the `model` a request names to use it"},
        "path": {"type": "string", "pattern": STORE_PATH, "maxLength": 1024,
                 "description": "its directory under spec.lora.path (default: the name)"},
        "rank": {"type": "integer", "minimum": 1, "maximum": VLLM_MAX_LORA_RANKS[-1],
                 "description": "its rank, checked against maxLoraRank (the engine checks the adapter's own)"},
        "pinned": {"type": "boolean", "default": False,
                   "description": "kvfleet engines keep its weights in host memory, never evicted"}}}
    adapters = {"type": "array", "maxItems": MAX_FLEET_ADAPTERS, "items": adapter,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                "description": "the adapters every engine pod serves, by name"}
    return {"lora": lora, "loraAdapters": adapters}


# The rank check across fields (spec level): a declared rank over maxLoraRank (or its default) is refused.
RANK_RULE = {"rule": "!has(self.loraAdapters) || !has(self.lora) || !has(self.lora.maxLoraRank) || "
                     "self.loraAdapters.all(a, !has(a.rank) || a.rank <= self.lora.maxLoraRank)",
             "message": "an adapter's rank must not exceed spec.lora.maxLoraRank"}
STORE_RULE = {"rule": "!has(self.loraAdapters) || size(self.loraAdapters) == 0 || has(self.lora)",
              "message": "spec.loraAdapters needs spec.lora: a store (a volume) or a path (in the image)"}
