"""Paged decode attention for CPUs, compiled by numba: each KV block is read in place, once, for all the query heads
that share it.

The plain-torch path gathers every sequence's blocks into a contiguous copy, then attends over the copy: the KV
cache crosses memory three times (read, write, read), which was ~30 % of a decode-heavy run on this machine
(docs/benchmarks.md). Here each (sequence, KV head) pair walks its block table once, scores the block's keys against
the group's query heads while the block is in L1, and folds the values in with an online softmax, as the Triton
decode kernel does on GPUs (kernels/decode_attention.py). float32 and bfloat16 caches (numpy has no bfloat16: its
raw bits are read as uint16 and widened block by block); the engine keeps the torch path for other dtypes.

A block's softmax weights come from a branch-free exp (_exp_shifted) in a loop of their own, which LLVM vectorizes;
numpy's exp per score stayed a scalar call: 12-21 % less time for the kernel, measured against the previous
version in one process, alternating (docs/benchmarks.md, `python -m bench.cpu_decode_kernel`).

While a block is scored, the next block of the sequence is prefetched (_prefetch_block): once blocks have been freed
and handed out again a sequence's blocks are scattered over the pool, and the kernel took ~2x as long over scattered
blocks as over consecutive ones; prefetching took 17-20 % off the scattered case (float32, 64 sequences of 180-240
tokens, 30 calls, three alternating runs on a 2-core AMD EPYC) and left the consecutive case as it was.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch

from kvfleet.kernels.numba_build import CACHE_LINE, compile_kernel, prefetch

# Cephes' expf: exp(x) = 2^n * e^r, n = round(x / ln 2), r = x - n * ln 2 in two parts (exact to float32), e^r by a
# degree-7 polynomial; within 1e-6 of the true value on the range softmax uses (x <= 0: a few float32 ulps, since
# fastmath may reassociate the two-part reduction).
LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_FLOOR = np.float32(-87.0)  # exp(-87) is still a normal float32; below it a weight is 0 to float32 anyway


def _exp_shifted(scores, count, top, exponents):  # pragma: no cover - compiled by numba
    """scores[:count] = exp(scores[:count] - top) (top >= every score), without branches or calls so that the loop
    vectorizes; exponents [count] int32 is scratch for the powers of two. Returns their sum."""
    for i in range(count):
        x = max(scores[i] - top, EXP_FLOOR)
        n = np.floor(x * LOG2E + np.float32(0.5))
        r = x - n * LN2_HI - n * LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        scores[i] = p * r * r + r + np.float32(1.0)
        exponents[i] = (np.int32(n) + np.int32(127)) << np.int32(23)  # 2^n's float32 bits
    powers = exponents.view(np.float32)
    total = np.float32(0.0)
    for i in range(count):
        scores[i] *= powers[i]
        total += scores[i]
    return total


def _attend_block(queries, keys, values, count, scores, exponents, running_max, denom, acc):  # pragma: no cover
    """Fold one block's first `count` keys and values (float32 [block_size, D]) into every query head's online
    softmax state: running_max, denom [G], acc [G, D]. scores and exponents [block_size] are scratch."""
    group, head_dim = queries.shape
    for g in range(group):
        top = running_max[g]
        for t in range(count):
            dot = np.float32(0.0)
            for x in range(head_dim):
                dot += queries[g, x] * keys[t, x]
            scores[t] = dot
            if dot > top:
                top = dot
        rescale = np.exp(running_max[g] - top)
        for x in range(head_dim):
            acc[g, x] *= rescale
        running_max[g] = top
        denom[g] = denom[g] * rescale + _exp_shifted(scores, count, top, exponents)
        for t in range(count):
            weight = scores[t]
            for x in range(head_dim):
                acc[g, x] += weight * values[t, x]


def _widen_bf16(bits, count, out):  # pragma: no cover - compiled by numba
    """out[:count] = the bfloat16 rows `bits` (their raw 16 bits) as float32: a bfloat16 is a float32's top half."""
    wide = out.view(np.uint32)
    for t in range(count):
        for x in range(bits.shape[1]):
            wide[t, x] = np.uint32(bits[t, x]) << np.uint32(16)


def _prefetch_block(k_cache, v_cache, head, block):  # pragma: no cover - compiled by numba
    """Start loading a block's keys and values (one contiguous row each) while the current block is scored: a
    sequence's blocks lie anywhere in the pool once blocks have been freed and handed out again, where the CPU's
    own prefetchers, which follow addresses within a page, cannot guess the next one."""
    row = k_cache.shape[2] * k_cache.shape[3]
    start = (head * k_cache.shape[1] + block) * row
    flat_keys, flat_values = k_cache.reshape(-1), v_cache.reshape(-1)
    for at in range(start, start + row, CACHE_LINE // k_cache.itemsize):
        prefetch(flat_keys, at)
        prefetch(flat_values, at)


def _decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, out):  # pragma: no cover - compiled by numba
    """q, out [B, KVH, G, D] float32; k_cache, v_cache [KVH, num_blocks, block_size, D]: float32, or the raw bits of
    bfloat16 as uint16 (each block widened into a float32 copy while it is in L1); block_tables [B, W]; seq_lens [B]."""
    batch, kv_heads, group, head_dim = q.shape
    block_size = k_cache.shape[2]
    widen = k_cache.itemsize == 2
    for job in numba.prange(batch * kv_heads):
        b = job // kv_heads
        h = job - b * kv_heads
        length = seq_lens[b]
        acc = np.zeros((group, head_dim), np.float32)
        running_max = np.full(group, -np.inf, np.float32)
        denom = np.zeros(group, np.float32)
        scores = np.empty(block_size, np.float32)
        exponents = np.empty(block_size, np.int32)
        queries = np.empty((group, head_dim), np.float32)
        wide_keys = np.empty((block_size, head_dim), np.float32)
        wide_values = np.empty((block_size, head_dim), np.float32)
        for g in range(group):
            for x in range(head_dim):
                queries[g, x] = q[b, h, g, x] * scale
        num_seq_blocks = (length + block_size - 1) // block_size
        for j in range(num_seq_blocks):
            block = block_tables[b, j]
            count = min(block_size, length - j * block_size)
            if j + 1 < num_seq_blocks:
                _prefetch_block(k_cache, v_cache, h, block_tables[b, j + 1])
            if widen:
                _widen_bf16(k_cache[h, block], count, wide_keys)
                _widen_bf16(v_cache[h, block], count, wide_values)
                _attend_block(queries, wide_keys, wide_values, count, scores, exponents, running_max, denom, acc)
            else:
                _attend_block(queries, k_cache[h, block], v_cache[h, block], count, scores, exponents, running_max,
                              denom, acc)
        for g in range(group):
            inverse = np.float32(1.0) / denom[g] if denom[g] > 0 else np.float32(0.0)
            for x in range(head_dim):
                out[b, h, g, x] = acc[g, x] * inverse


# compiled in order: the kernel calls the helpers by their global names
_exp_shifted = compile_kernel(_exp_shifted, inline="always")
_attend_block = compile_kernel(_attend_block, inline="always")
_widen_bf16 = compile_kernel(_widen_bf16, inline="always")
_prefetch_block = compile_kernel(_prefetch_block, inline="always")
_kernel = compile_kernel(_decode_kernel, parallel=True)
# numba's default thread pool ("workqueue") must not be entered from two threads at once: engines that share a
# process take turns.
_launch = threading.Lock()
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence); k_cache, v_cache [KVH, num_blocks, block_size * D], float32 or
    bfloat16; block_tables [B, W] (padding beyond a sequence's blocks is never read); seq_lens [B] tokens to attend
    to. Returns [B, H, D] in q's dtype; scores and sums are float32 whatever the cache's dtype."""
    if k_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"the CPU decode kernel reads float32 or bfloat16 caches, not {k_cache.dtype}")
    batch, heads, head_dim = q.shape
    kv_heads, num_blocks = k_cache.shape[0], k_cache.shape[1]
    queries = q.to(torch.float32).contiguous().view(batch, kv_heads, heads // kv_heads, head_dim)
    out = torch.empty_like(queries)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    with _launch:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        _kernel(queries.numpy(), _raw(k_cache.view(shape)), _raw(v_cache.view(shape)),
                block_tables.numpy(), seq_lens.numpy(), np.float32(scale), out.numpy())
    return out.view(batch, heads, head_dim).to(q.dtype)


def _raw(cache: torch.Tensor) -> np.ndarray:
    """The cache as numba reads it: float32 as is, bfloat16 as its raw 16 bits (numpy has no bfloat16)."""
    return cache.view(torch.uint16).numpy() if cache.dtype == torch.bfloat16 else cache.numpy()
