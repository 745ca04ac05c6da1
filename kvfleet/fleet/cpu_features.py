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


def auto_cpu_dtype(flags: frozenset[str] | None, onednn_bf16: bool) -> tuple[str, str]:
    """The engine's `--dtype auto` on a CPU, and why: bfloat16 where the CPU has bfloat16 instructions and torch's
    oneDNN runs bfloat16 GEMMs on them (on such CPUs kvfleet's engine served 1.5x its float32 tokens/s, issue 37),
    else float32 (bfloat16 would be emulated in float32 arithmetic, slower than float32 itself)."""
    found = sorted(BF16_FLAGS & flags) if flags is not None else []
    if found and onednn_bf16:
        return "bfloat16", (f"this CPU has bfloat16 instructions ({', '.join(found)}); --dtype float32 for answers "
                            "equal to transformers' float32")
    if found:
        return "float32", "this torch's oneDNN runs no bfloat16 GEMMs"
    if flags is None:
        return "float32", "no /proc/cpuinfo to say whether this CPU has bfloat16 instructions"
    return "float32", ("this CPU has no bfloat16 instructions (AVX-512 BF16 or AMX), where bfloat16 would be "
                       "emulated, slower than float32")
