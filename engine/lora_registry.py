"""Which LoRA adapters the engine serves, by name, and the ones read into host memory (vLLM's --max-cpu-loras LRU).

An adapter is registered under a name with its directory (from --lora-modules at start, or POST /v1/load_lora_adapter
from an allowed directory), read and checked in full before the name answers: a name that answers is an adapter that
loads. Each registration gets a new id, which keys its prefix-cache blocks: an adapter loaded again under the same
name (perhaps with new weights) never hits the blocks of the one before. Requests hold their adapter's LoraSpec, so
an unload stops new requests while those in flight finish, reading the adapter again if it was evicted meanwhile.

The API server's threads register and look up; the engine thread reads adapters: one lock guards both.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfleet.engine.lora_adapter import AdapterError, LoraAdapter
from kvfleet.fleet.lora import ADAPTER_NAME_RULE, valid_adapter_name

MAX_ADAPTERS = 1024  # names registered at once: a load storm is refused past it, not kept in memory


class LoraNotFoundError(KeyError):
    """No adapter of that name is registered."""


@dataclass(frozen=True)
class LoraSpec:
    """A registered adapter: its name, its directory, and the id of this registration."""

    name: str
    path: Path
    id: int


def check_name(name: object) -> str:
    if not valid_adapter_name(name):
        raise AdapterError(f"an adapter's name is {ADAPTER_NAME_RULE}, not {name!r:.200}")
    return name


def inside_allowed(path: Path, allowed: list[Path]) -> bool:
    """Whether path, with every symlink and `..` resolved, lies under one of the allowed directories."""
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in allowed)


class LoraRegistry:
    def __init__(self, read: Callable[[str, Path], LoraAdapter], max_cpu_loras: int,
                 allowed_dirs: list[str] | None = None, reserved_names: tuple[str, ...] = ()) -> None:
        self._read = read  # (name, directory) -> the adapter, checked against the base model
        self.max_cpu_loras = max_cpu_loras
        self.allowed_dirs = [Path(d).resolve() for d in allowed_dirs or []]
        self.reserved_names = set(reserved_names)  # the base model's names: no adapter may take one
        self._specs: dict[str, LoraSpec] = {}
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()  # by LoraSpec.id, least recently used first
        self._ids = itertools.count(1)
        self._pinned: set[int] = set()  # ids whose weights are never evicted from host memory
        self._lock = threading.Lock()
        self.loads = 0  # adapters read from disk (a registration or a read after eviction)

    @property
    def runtime_loading(self) -> bool:
        return bool(self.allowed_dirs)

    def names(self) -> list[LoraSpec]:
        with self._lock:
            return list(self._specs.values())

    def get(self, name: str) -> LoraSpec:
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            raise LoraNotFoundError(name)
        return spec

    def lookup(self, name: str) -> LoraSpec | None:
        with self._lock:
            return self._specs.get(name)

    def register(self, name: str, path: str | Path, *, check_allowed: bool, pinned: bool = False) -> LoraSpec:
        """Read and check the adapter, then answer to its name; AdapterError (nothing kept) if it does not fit.
        check_allowed: the path must lie under --lora-allowed-dirs (a client named it; the command line is trusted).
        pinned: its weights stay in host memory, never evicted (at most --max-cpu-loras adapters are pinned).
        """
        if name in self.reserved_names:
            raise AdapterError(f"{name!r} is the base model's name; give the adapter another")
        check_name(name)
        if "\x00" in str(path):
            raise AdapterError("the adapter path has a NUL byte; name a directory")
        directory = Path(path)
        try:
            outside = check_allowed and not inside_allowed(directory, self.allowed_dirs)
        except (OSError, RuntimeError) as err:  # a symlink loop, a name too long
            raise AdapterError(f"the adapter path {str(path)[:300]!r} cannot be resolved: {err}") from None
        if outside:
            raise AdapterError(f"the adapter path {str(path)!r} is outside the directories adapters may be loaded "
                               "from (--lora-allowed-dirs)")
        with self._lock:
            if name in self._specs:
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first or use another "
                                   "name")
            if len(self._specs) >= MAX_ADAPTERS:
                raise AdapterError(f"{MAX_ADAPTERS} adapters are loaded already; unload one first")
            self._check_pin(pinned)
        adapter = self._read(name, directory)  # outside the lock: reading takes milliseconds to seconds
        with self._lock:
            if name in self._specs:  # another load of the same name finished first
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first or use another "
                                   "name")
            self._check_pin(pinned)
            spec = LoraSpec(name, directory, next(self._ids))
            self._specs[name] = spec
            self.loads += 1
            if pinned:
                self._pinned.add(spec.id)
            self._keep(spec.id, adapter)
        return spec

    def _check_pin(self, pinned: bool) -> None:
        if pinned and len(self._pinned) >= self.max_cpu_loras:
            raise AdapterError(f"{len(self._pinned)} adapters are pinned already, as many as --max-cpu-loras "
                               f"({self.max_cpu_loras}) keeps in host memory; load this one unpinned, unload a "
                               "pinned one, or raise --max-cpu-loras")

    def unregister(self, name: str) -> LoraSpec:
        with self._lock:
            spec = self._specs.pop(name, None)
            if spec is None:
                raise LoraNotFoundError(name)
            self._host.pop(spec.id, None)
            self._pinned.discard(spec.id)
        return spec

    def pinned(self, spec: LoraSpec) -> bool:
        with self._lock:
            return spec.id in self._pinned

    def adapter(self, spec: LoraSpec) -> LoraAdapter:
        """The adapter's weights: from host memory, or read again from its directory (AdapterError if that fails:
        the directory changed since it was loaded)."""
        with self._lock:
            adapter = self._host.get(spec.id)
            if adapter is not None:
                self._host.move_to_end(spec.id)
                return adapter
        adapter = self._read(spec.name, spec.path)
        with self._lock:
            self.loads += 1
            if spec.name in self._specs and self._specs[spec.name].id == spec.id:
                self._keep(spec.id, adapter)
        return adapter

    def _keep(self, spec_id: int, adapter: LoraAdapter) -> None:
        """Keep the adapter read, evicting the least recently used unpinned ones past --max-cpu-loras (the one
        just read too, when every other is pinned)."""
        self._host[spec_id] = adapter
        self._host.move_to_end(spec_id)
        over = len(self._host) - self.max_cpu_loras
        if over > 0:
            for old in [k for k in self._host if k not in self._pinned][:over]:
                del self._host[old]

    @property
    def num_in_host_memory(self) -> int:
        with self._lock:
            return len(self._host)
