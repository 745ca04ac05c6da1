"""Attention for a ragged batch of prefill chunks over a paged context (chunked prefill, prefix caching).

Sequence i brings query_lens[i] new tokens after context_lens[i] tokens already cached; its new K/V must be
written to the cache first, so every key is read through the block table. A query at position p attends to
keys 0..p: all of the cached prefix, causally within the chunk. One program takes BLOCK_M queries of one head
of one sequence and walks the keys they can see TILE_N tokens at a time with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.paged_reference import attend, gather_context
from kvfleet.kernels.paged_tile import attend_tile

LOG2E = 1.4426950408889634
BLOCK_M = 32  # queries per program
TILE_N = 64  # keys per loop iteration


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_starts_ptr, context_lens_ptr, out_ptr, qk_scale,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_head, stride_cache_block, stride_table_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_tile = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - query_start
    if query_tile * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    positions = context_len + rows
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < HEAD_DIM
    q_mask = (rows < query_len)[:, None] & in_dim[None, :]
    tokens_at = (query_start + rows)[:, None]
    q = tl.load(q_ptr + tokens_at * stride_q_token + head * stride_q_head + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    cache_head = (head // GROUP).to(tl.int64) * stride_cache_head
    table = block_tables_ptr + seq * stride_table_seq
    key_end = context_len + tl.minimum(query_len, (query_tile + 1) * BLOCK_M)  # the tile's last query sees these

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(0, key_end, TILE_N):
        keys = tile + tl.arange(0, TILE_N)
        valid = keys < key_end
        # Key 0 is visible to every query, so no row is all -inf after the first tile.
        visible = valid[None, :] & (keys[None, :] <= positions[:, None])
        acc, running_sum, running_max = attend_tile(
            q, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, keys, valid, visible, dims, in_dim,
            qk_scale, acc, running_sum, running_max, BLOCK_SIZE, HEAD_DIM)

    out_at = out_ptr + tokens_at * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_at, acc / running_sum[:, None], mask=q_mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_starts: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                      scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] for the chunks laid end to end (query_starts [S + 1]) over caches [KVH, blocks, block_size * D].

    block_tables [S, W] and context_lens [S] per sequence; the chunks' own K/V are already in the cache.
    Returns [T, H, D] (into `out` when given).
    """
    num_seqs = context_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[0]
    out = torch.empty_like(q) if out is None else out
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_starts, context_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[2] // head_dim, BLOCK_M=BLOCK_M, TILE_N=TILE_N,
    )
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_starts: torch.Tensor,
                                context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention, one sequence at a time, in float32 torch."""
    head_dim = q.shape[-1]
    out = torch.empty_like(q)
    starts = query_starts.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        total = context_len + end - start
        keys = gather_context(k_cache, block_tables[i], total, head_dim)
        values = gather_context(v_cache, block_tables[i], total, head_dim)
        out[start:end] = attend(q[start:end], keys, values, scale, first_position=context_len)
    return out
