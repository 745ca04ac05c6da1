"""Paged attention for decode: one query token per sequence over its cached context.

One program takes one (sequence, KV head, split). The query heads that share the KV head are the rows of one
tile, so each K/V row is read once for the whole group (grouped-query attention). The program walks its part of
the context TILE_N tokens (several KV blocks) at a time with an online softmax. When the batch has too few
(sequence, KV head) pairs to fill the GPU, the context is cut into splits whose partial results a second kernel
merges by their log-sum-exp (split-K, "flash decoding").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvfleet.kernels.paged_reference import attend, gather_context
from kvfleet.kernels.paged_tile import attend_tile

LOG2E = 1.4426950408889634
TILE_N = 64  # context tokens per loop iteration
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    qk_scale, tokens_per_split,
    stride_q_seq, stride_q_head, stride_cache_head, stride_cache_block, stride_table_seq,
    stride_out_seq, stride_out_head, stride_out_split, stride_lse_seq, stride_lse_head,
    GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, STORE_LSE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(tl.load(seq_lens_ptr + seq), start + tokens_per_split)

    rows = tl.arange(0, BLOCK_GROUP)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < HEAD_DIM
    q_mask = (rows < GROUP)[:, None] & in_dim[None, :]
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    cache_head = kv_head.to(tl.int64) * stride_cache_head
    table = block_tables_ptr + seq * stride_table_seq

    running_max = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_D], tl.float32)
    for tile in range(start, end, TILE_N):
        tokens = tile + tl.arange(0, TILE_N)
        valid = tokens < end
        acc, running_sum, running_max = attend_tile(
            q, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, tokens, valid, valid[None, :], dims,
            in_dim, qk_scale, acc, running_sum, running_max, BLOCK_SIZE, HEAD_DIM)

    # A split past a shorter sequence's end saw no tokens: it stores zeros with a log-sum-exp of -inf.
    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    out_rows = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + split * stride_out_split
    tl.store(out_rows + dims[None, :], acc / safe_sum[:, None], mask=q_mask)
    if STORE_LSE:
        lse_at = lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split
        tl.store(lse_at, running_max + tl.log2(safe_sum), mask=rows < GROUP)


@triton.jit
def _merge_splits_kernel(
    parts_ptr, lse_ptr, out_ptr, num_splits,
    stride_parts_seq, stride_parts_head, stride_lse_seq, stride_lse_head, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    in_split = splits < num_splits
    lse = tl.load(lse_ptr + seq * stride_lse_seq + head * stride_lse_head + splits, mask=in_split,
                  other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    part_at = parts_ptr + seq * stride_parts_seq + head * stride_parts_head + splits[:, None] * HEAD_DIM
    parts = tl.load(part_at + dims[None, :], mask=in_split[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    merged = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, merged, mask=dims < HEAD_DIM)


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence: enough for about two programs per SM, none shorter than MIN_SPLIT_TOKENS."""
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    by_length = max(max_context // MIN_SPLIT_TOKENS, 1)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] over caches [KVH, blocks, block_size * D] through block_tables [B, W]; seq_lens [B] >= 1.

    Returns [B, H, D] (into `out` when given). num_splits defaults to choose_num_splits for the device.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    block_size = k_cache.shape[2] // head_dim
    max_context = block_tables.shape[1] * block_size  # a bound known without reading seq_lens back
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_context, _num_sms(q.device))
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), TILE_N) * TILE_N
    num_splits = triton.cdiv(max_context, tokens_per_split)
    out = torch.empty_like(q) if out is None else out
    if num_splits == 1:
        parts, lse = out.unsqueeze(2), out  # one split is the answer: no log-sum-exp is stored
    else:
        parts = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, parts, lse,
        scale * LOG2E, tokens_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE_N=TILE_N, STORE_LSE=num_splits > 1,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            parts, lse, out, num_splits,
            parts.stride(0), parts.stride(1), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        )
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """The same attention, one sequence at a time, in float32 torch."""
    head_dim = q.shape[-1]
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        keys = gather_context(k_cache, block_tables[i], length, head_dim)
        values = gather_context(v_cache, block_tables[i], length, head_dim)
        out[i] = attend(q[i : i + 1], keys, values, scale, first_position=length - 1)[0]
    return out
