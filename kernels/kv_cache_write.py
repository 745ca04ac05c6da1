"""Write a step's new K/V rows into the paged cache by slot mapping (vLLM's reshape_and_cache).

Caches are one layer's `[kv_head, block, block_size * head_dim]`: slot `block * block_size + offset`
of head h starts at `h * stride_head + slot * head_dim`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_cache_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < HEAD_DIM
    dst = head.to(tl.int64) * stride_cache_head + slot * HEAD_DIM + dims
    k = tl.load(k_ptr + token * stride_k_token + head * stride_k_head + dims, mask=in_dim)
    v = tl.load(v_ptr + token * stride_v_token + head * stride_v_head + dims, mask=in_dim)
    tl.store(k_cache_ptr + dst, k, mask=in_dim)
    tl.store(v_cache_ptr + dst, v, mask=in_dim)


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] (rows contiguous) into k_cache, v_cache [KVH, blocks, block_size * D] at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """The same write with torch indexing."""
    num_kv_heads, head_dim = k.shape[1:]
    for cache, new in ((k_cache, k), (v_cache, v)):
        slots = cache.view(num_kv_heads, -1, head_dim)
        slots[:, slot_mapping] = new.transpose(0, 1).to(cache.dtype)
