"""What this machine's CPU can do, read from /proc/cpuinfo (no torch import: `kvfleet up` reads it before it starts a
runtime). Its instruction sets decide a runtime's fast dtype: bfloat16 runs natively only with AVX-512 BF16 or AMX
on x86 (ARM: the `bf16` feature); elsewhere it is emulated in float32 arithmetic, and slower than float32 itself."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 `flags`; aarch64 `Features` says `bf16`
CPUINFO = Path("/proc/cpuinfo")


def has_bf16_instructions(flags: Iterable[str]) -> bool:
    return not BF16_FLAGS.isdisjoint(flags)


def flags_have_bf16(flags: frozenset[str] | None) -> bool | None:
    """Whether these CPU flags (host_cpu_flags' answer) have bfloat16 instructions; None where nobody could say."""
    return None if flags is None else has_bf16_instructions(flags)


def cpu_flags(text: str) -> frozenset[str]:
    """The first CPU's feature flags in /proc/cpuinfo's text (x86 `flags`, aarch64 `Features`)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def host_cpu_flags(path: Path = CPUINFO) -> frozenset[str] | None:
    """This machine's CPU flags; None where /proc/cpuinfo is not there to say (not Linux)."""
    try:
        return cpu_flags(path.read_text())
    except OSError:
        return None
