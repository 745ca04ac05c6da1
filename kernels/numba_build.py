"""How kvfleet's CPU kernels are compiled by numba: cached on disk where numba can write, else at every start; on
CPUs with AVX-512, with 512-bit vectors.

LLVM's tuning for Intel server CPUs (Skylake-SP to Emerald Rapids) prefers 256-bit vectors even where AVX-512 is there
(the `prefer-256-bit` tuning flag: Skylake lowered its clock for 512-bit instructions), so numba's loops ran on ymm
registers at half the width vLLM's hand-written AVX-512 kernels use. Measured on this project's 2-core Emerald Rapids
VM (2026-11-29), the paged decode attention took 12-24 % less time with the flag off (docs/benchmarks.md). Where the
user sets numba's own NUMBA_CPU_NAME or NUMBA_CPU_FEATURES, theirs stand."""

from __future__ import annotations

import logging
import os

import numba
from llvmlite import ir
from numba import types
from numba.core import config
from numba.extending import intrinsic

log = logging.getLogger(__name__)

WIDE_VECTORS = "-prefer-256-bit"


def wide_vector_features(host_features: str) -> str | None:
    """The features to compile with so that loops use 512-bit vectors, or None where the CPU has no AVX-512 or the
    tuning is already off. Pure: host_features is LLVM's comma-separated list (`+avx512f,-amx-fp16,...`)."""
    features = host_features.split(",")
    if "+avx512f" not in features or WIDE_VECTORS in features:
        return None
    return ",".join([*features, WIDE_VECTORS])


def _prefer_wide_vectors() -> None:
    """Before any kernel compiles (numba builds its code generator on the first compilation, from these settings)."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES") or config.CPU_FEATURES is not None:
        return
    from llvmlite import binding

    features = wide_vector_features(binding.get_host_cpu_features().flatten())
    if features is not None:
        config.CPU_NAME, config.CPU_FEATURES = binding.get_host_cpu_name(), features


_prefer_wide_vectors()


def compile_kernel(function, **options):
    """numba.njit(function) with fastmath and the GIL released, cached where numba can write (a read-only image
    cannot: the kernel is then compiled at start)."""
    options = {"fastmath": True, "nogil": True, **options}
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError as err:  # no writable place for numba's cache (a read-only image): compile at every start
        log.info("numba cannot cache %s (%s); it compiles at start instead", function.__name__, err)
        return numba.njit(**options)(function)


CACHE_LINE = 64  # bytes


@intrinsic
def prefetch(typingctx, array, index):  # noqa: ANN001, ARG001 - numba's intrinsic signature
    """prefetch(array, i) in a kernel: ask the CPU to bring the cache line holding array.flat[i] into every level of
    its cache (LLVM's llvm.prefetch: a read, high locality); no effect on results. array is C-contiguous."""
    signature = types.void(array, index)

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        address = builder.gep(data, [args[1]])
        i32 = ir.IntType(32)
        function_type = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        function = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(builder.module, function_type,
                                                                                    name="llvm.prefetch.p0")
        builder.call(function, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return signature, codegen
