"""The ragged prefill-chunk attention kernel agrees with its torch reference (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from tests.support.paged_cases import (
    BLOCK_SIZES,
    CONTEXT_LENS,
    HEAD_DIMS,
    QUERIES_PER_KV_HEAD,
    block_tables_for,
    kv_heads_for,
    num_blocks_for,
    random_caches,
)

# (cached context, new tokens) per sequence: a fresh prompt, then each context length of the grid with chunks of
# one token, a block, a chunk wider than one program's 32 queries, and a few tokens after a long cached prefix.
CHUNKS = [(0, 17), *zip(CONTEXT_LENS, (33, 1, 16, 40, 9), strict=True)]


def run_both(chunks: list[tuple[int, int]], head_dim: int, group: int, block_size: int, dtype: torch.dtype,
             shared_prefix_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_kv_heads = kv_heads_for(group)
    tables = block_tables_for([c + n for c, n in chunks], block_size, shared_prefix_blocks)
    k_cache, v_cache = random_caches(num_kv_heads, num_blocks_for(tables), block_size, head_dim, dtype)
    starts = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()])
    context_lens = torch.tensor([c for c, _ in chunks])
    q = torch.randn(int(starts[-1]), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = prefill_attention(q, k_cache, v_cache, tables, starts, context_lens, max(n for _, n in chunks), scale)
    expected = prefill_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, starts,
                                           context_lens, scale)
    return out, expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", QUERIES_PER_KV_HEAD)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_ragged_chunks_over_cached_prefixes_match_the_reference(head_dim: int, group: int, block_size: int) -> None:
    torch.manual_seed(head_dim + group + block_size)
    out, expected = run_both(CHUNKS, head_dim, group, block_size, torch.float32, shared_prefix_blocks=1)
    assert (out - expected).abs().max().item() <= 1e-4


def test_float16_matches_the_float32_reference_loosely() -> None:
    torch.manual_seed(0)
    out, expected = run_both([(0, 20), (257, 9)], 128, 8, 16, torch.float16, shared_prefix_blocks=0)
    assert out.dtype == torch.float16
    assert (out.float() - expected).abs().max().item() <= 1e-2
