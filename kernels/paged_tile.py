"""The step both attention kernels repeat: one tile of keys read through a block table into an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, keys, valid, visible, dims,
                in_dim, qk_scale, acc, running_sum, running_max,
                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Read the K/V rows of `keys` (token positions, `valid` where they exist) through the block table, attend
    the rows of q [M, D] to the `visible` ones ([M, N] or [1, N]), and fold them into the running softmax
    (acc [M, D], running_sum and running_max [M], base 2). Returns the updated three."""
    blocks = tl.load(table + keys // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = cache_head + blocks * stride_cache_block + (keys % BLOCK_SIZE) * HEAD_DIM
    kv_offsets = rows[:, None] + dims[None, :]
    kv_mask = valid[:, None] & in_dim[None, :]
    # "ieee" keeps float32 caches exact (no TF32); half-precision inputs ignore it.
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    probs = tl.exp2(scores - new_max[:, None])
    rescale = tl.exp2(running_max - new_max)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
    return acc, running_sum * rescale + tl.sum(probs, 1), new_max
