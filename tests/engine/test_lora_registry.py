"""The engine's adapter registry as its host-memory LRU behaves (vLLM's --max-cpu-loras), with pinned adapters that
are never evicted. The reader stands in for reading a PEFT directory (tests/engine/test_lora.py reads real ones):
here only which adapters are read again matters."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.lora_adapter import AdapterError
from kvfleet.engine.lora_registry import LoraRegistry


def registry(max_cpu_loras: int) -> tuple[LoraRegistry, list[str]]:
    reads: list[str] = []

    def read(name: str, path: Path) -> object:
        reads.append(name)
        return object()

    return LoraRegistry(read, max_cpu_loras), reads


def test_the_least_recently_used_unpinned_adapter_is_evicted_and_a_pinned_one_never_is() -> None:
    lora, reads = registry(max_cpu_loras=2)
    pinned = lora.register("pinned", "/a/pinned", check_allowed=False, pinned=True)
    first = lora.register("first", "/a/first", check_allowed=False)
    lora.register("second", "/a/second", check_allowed=False)  # over 2: `first` goes, `pinned` stays
    reads.clear()
    lora.adapter(pinned)
    assert reads == []
    lora.adapter(first)
    assert reads == ["first"]
    assert lora.num_in_host_memory == 2 and lora.pinned(pinned) and not lora.pinned(first)


def test_pins_stop_at_max_cpu_loras_and_an_unload_frees_one() -> None:
    lora, _ = registry(max_cpu_loras=1)
    lora.register("a", "/a/a", check_allowed=False, pinned=True)
    with pytest.raises(AdapterError, match="--max-cpu-loras"):
        lora.register("b", "/a/b", check_allowed=False, pinned=True)
    assert [s.name for s in lora.names()] == ["a"]
    unpinned = lora.register("c", "/a/c", check_allowed=False)  # read, used, not kept: the one place is pinned
    assert lora.num_in_host_memory == 1 and not lora.pinned(unpinned)
    lora.unregister("a")
    assert lora.register("b", "/a/b", check_allowed=False, pinned=True).name == "b"
