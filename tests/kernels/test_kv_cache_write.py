"""The KV-cache write kernel puts each new K/V row in the slot the block table gives it, as its reference does."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from tests.support.paged_cases import (
    BLOCK_SIZES,
    CONTEXT_LENS,
    HEAD_DIMS,
    block_tables_for,
    num_blocks_for,
    random_caches,
)


def slots_of(tables: torch.Tensor, positions: list[list[int]], block_size: int) -> torch.Tensor:
    return torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                         for i, seq_positions in enumerate(positions) for p in seq_positions])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_kv_heads", (1, 3))
def test_prefill_and_decode_rows_land_where_the_reference_puts_them(num_kv_heads: int, head_dim: int,
                                                                   block_size: int) -> None:
    torch.manual_seed(num_kv_heads + head_dim + block_size)
    lengths = list(CONTEXT_LENS)
    tables = block_tables_for(lengths, block_size)
    # A step's tokens: every position of the short sequences (a prefill), the last one of the long (a decode).
    positions = [list(range(n)) if n < 100 else [n - 1] for n in lengths]
    slots = slots_of(tables, positions, block_size)
    k = torch.randn(len(slots), num_kv_heads, head_dim)
    v = torch.randn(len(slots), num_kv_heads, head_dim)
    k_cache, v_cache = random_caches(num_kv_heads, num_blocks_for(tables), block_size, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k_cache, v_cache, k, v, slots)
    write_kv_cache_reference(expected_k, expected_v, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_strided_rows_of_a_fused_projection_are_written_in_float16() -> None:
    """k and v as the model makes them: column slices of one q/k/v projection, not contiguous tensors."""
    torch.manual_seed(0)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, dtype=torch.float16)
    k = qkv[:, 4 * 64:6 * 64].view(5, 2, 64)
    v = qkv[:, 6 * 64:].view(5, 2, 64)
    slots = torch.tensor([3, 16, 17, 40, 63])
    k_cache, v_cache = random_caches(2, 4, 16, 64, torch.float16)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k_cache, v_cache, k, v, slots)
    write_kv_cache_reference(expected_k, expected_v, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
