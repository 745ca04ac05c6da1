"""The CPU decode kernel (numba, reads KV blocks in place; float32 or bfloat16 caches) agrees with the torch reference
and never reads padding."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from kvfleet.engine.attention import DecodeGroup, TorchAttentionBackend
from kvfleet.kernels.cpu_decode_attention import paged_decode_attention
from kvfleet.kernels.decode_attention import paged_decode_attention_reference
from tests.support.paged_cases import (
    BLOCK_SIZES,
    CONTEXT_LENS,
    HEAD_DIMS,
    QUERIES_PER_KV_HEAD,
    block_tables_for,
    decode_case,
    kv_heads_for,
    num_blocks_for,
)


@pytest.mark.parametrize("block_size", (8, *BLOCK_SIZES))
@pytest.mark.parametrize("group", QUERIES_PER_KV_HEAD)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mixed_context_lengths_with_a_cached_prefix_match_the_reference(head_dim: int, group: int,
                                                                        block_size: int) -> None:
    torch.manual_seed(head_dim + group + block_size)
    q, k_cache, v_cache, tables, seq_lens = decode_case(list(CONTEXT_LENS), block_size, head_dim,
                                                        kv_heads_for(group), group, shared_prefix_blocks=1)
    k_cache[:, 0] = float("nan")  # block 0 pads the tables: a kernel that reads padding answers NaN
    v_cache[:, 0] = float("nan")
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, block_size, head_dim**-0.5)
    assert out.shape == q.shape
    assert (out - expected).abs().max().item() <= 1e-4


def test_large_scores_stay_finite() -> None:
    """The online softmax rescales by the running maximum: scores of a few hundred do not overflow exp."""
    torch.manual_seed(1)
    q, k_cache, v_cache, tables, seq_lens = decode_case([40, 3], 16, 64, num_kv_heads=1, group=3)
    q *= 200
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)
    assert torch.isfinite(out).all()
    assert (out - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("block_size", (8, 16))
@pytest.mark.parametrize("group", (1, 3))
def test_bfloat16_caches_are_read_in_place_and_match_the_reference_in_float32(group: int, block_size: int) -> None:
    """bfloat16 K/V (the raw bits widened block by block) and a bfloat16 query: the answer is the float32 attention
    over the same bfloat16 values, rounded once to bfloat16; padding is never read."""
    torch.manual_seed(group + block_size)
    q, k_cache, v_cache, tables, seq_lens = decode_case(list(CONTEXT_LENS), block_size, 64, kv_heads_for(group),
                                                        group, shared_prefix_blocks=1, dtype=torch.bfloat16)
    k_cache[:, 0] = float("nan")
    v_cache[:, 0] = float("nan")
    expected = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, 0.125)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, block_size, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert (out.float() - expected).abs().max().item() <= 1e-2  # bfloat16 keeps 8 bits of mantissa
    assert (out.float() - expected.to(torch.bfloat16).float()).abs().max().item() <= 1e-2


def test_a_cache_of_another_dtype_is_refused_by_name() -> None:
    q, k_cache, v_cache, tables, seq_lens = decode_case([5], 16, 64, num_kv_heads=1, group=1, dtype=torch.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_the_engines_cpu_backend_decodes_in_place_and_agrees_with_its_gathering_path(dtype: torch.dtype,
                                                                                     tolerance: float) -> None:
    torch.manual_seed(2)
    backend = TorchAttentionBackend(1, 9, 3, 64, 16, dtype, torch.device("cpu"))
    assert backend.decode_in_place is not None
    lengths = [200, 1, 33]
    tables = block_tables_for(lengths, 16)
    backend.allocate_kv_cache(num_blocks_for(tables))
    backend.kv_cache.normal_()
    k_cache, v_cache = backend.kv_cache[0]
    q = torch.randn(3, 9, 64).to(dtype)
    group = DecodeGroup(0, 3, tables, torch.tensor(lengths), 16, dtype)
    in_place = backend._decode(q, k_cache, v_cache, group)
    backend.decode_in_place = None
    gathered = backend._decode(q, k_cache, v_cache, group)
    assert in_place.dtype == dtype
    assert (in_place.float() - gathered.float()).abs().max().item() <= tolerance
    assert TorchAttentionBackend(1, 9, 3, 64, 16, torch.float16, torch.device("cpu")).decode_in_place is None


def test_engines_sharing_a_process_can_decode_from_several_threads() -> None:
    torch.manual_seed(3)
    q, k_cache, v_cache, tables, seq_lens = decode_case([300] * 8, 16, 64, num_kv_heads=2, group=3)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)
    results: list[torch.Tensor] = []

    def decode() -> None:
        for _ in range(20):
            results.append(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 16, 0.125))

    threads = [threading.Thread(target=decode) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 80
    assert all(torch.equal(result, expected) for result in results)


def test_without_a_writable_cache_the_kernel_compiles_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba refuses cache=True where it can write nowhere (a read-only image): the kernel is still built."""
    import numba

    from kvfleet.kernels import cpu_decode_attention
    from kvfleet.kernels.numba_build import compile_kernel

    real_njit = numba.njit

    def njit(*args, **options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function '_decode_kernel': no locator available")
        return real_njit(*args, **options)

    monkeypatch.setattr(numba, "njit", njit)
    kernel = compile_kernel(cpu_decode_attention._decode_kernel, parallel=True)
    assert type(kernel._cache).__name__ == "NullCache"  # built without an on-disk cache
    q, k_cache, v_cache, tables, seq_lens = decode_case([5], 16, 64, num_kv_heads=1, group=1)
    out = torch.empty_like(q)
    kernel(q.view(1, 1, 1, 64).numpy(), k_cache.view(1, -1, 16, 64).numpy(), v_cache.view(1, -1, 16, 64).numpy(),
           tables.numpy(), seq_lens.numpy(), 0.125, out.view(1, 1, 1, 64).numpy())
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert (out - expected).abs().max().item() <= 1e-4


def test_the_softmax_exp_is_within_a_millionth_of_the_true_exp_over_the_range_softmax_uses() -> None:
    from kvfleet.kernels.cpu_decode_attention import _exp_shifted

    top = np.float32(3.5)
    shifts = np.concatenate([-np.geomspace(1e-7, 120, 4093).astype(np.float32), [0, -1e-30, -86.9]]).astype(np.float32)
    scores = (top + shifts).astype(np.float32)
    expected = np.exp((scores - top).astype(np.float64))  # of the same float32 difference the kernel takes
    got = scores.copy()
    total = _exp_shifted(got, len(got), top, np.empty(len(got), np.int32))
    normal = expected > 1e-37  # below, the kernel floors at exp(-87) ~1.6e-38: as good as 0 beside the top weight 1
    # a few float32 ulps (fastmath may reassociate the two-part reduction); softmax weights need far less
    assert np.all(np.abs(got[normal] - expected[normal]) <= 1e-6 * expected[normal])
    assert np.all(got[~normal] < 1.1e-37) and np.all(got >= 0)
    assert total == pytest.approx(expected.sum(), rel=1e-5)


def test_on_an_avx512_cpu_the_kernels_compile_with_512_bit_vectors_unless_numbas_own_setting_says_otherwise() -> None:
    from kvfleet.kernels.numba_build import WIDE_VECTORS, wide_vector_features

    assert wide_vector_features("+sse4.2,+avx512f,-amx-fp16") == f"+sse4.2,+avx512f,-amx-fp16,{WIDE_VECTORS}"
    assert wide_vector_features("+sse4.2,+avx2,-avx512f") is None  # nothing wider to prefer
    assert wide_vector_features(f"+avx512f,{WIDE_VECTORS}") is None
    check = ("import kvfleet.kernels.numba_build; from numba.core import config; "
             "print(config.CPU_FEATURES or '')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    features = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()
    from llvmlite import binding

    assert features.endswith(WIDE_VECTORS) == ("+avx512f" in binding.get_host_cpu_features().flatten().split(","))
    mine = "+sse4.2,+avx2"
    assert subprocess.run([sys.executable, "-c", check], env={**env, "NUMBA_CPU_FEATURES": mine},
                          capture_output=True, text=True, check=True).stdout.strip() == mine
