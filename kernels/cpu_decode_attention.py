"""Paged decode attention for CPUs, compiled by numba: each KV block is read in place, once, for all the query heads
that share it.

The plain-torch path gathers every sequence's blocks into a contiguous copy, then attends over the copy: the KV
cache crosses memory three times (read, write, read), which was ~30 % of a decode-heavy run on this machine
(docs/benchmarks.md). Here each (sequence, KV head) pair walks its block table once, scores the block's keys against
the group's query heads while the block is in L1, and folds the values in with an online softmax, as the Triton
decode kernel does on GPUs (kernels/decode_attention.py). fp32 only; the engine keeps the torch path for other
dtypes.
"""

from __future__ import annotations

import logging
import threading

import numba
import numpy as np
import torch

log = logging.getLogger(__name__)


def _decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, out):  # pragma: no cover - compiled by numba
    """q, out [B, KVH, G, D]; k_cache, v_cache [KVH, num_blocks, block_size, D]; block_tables [B, W]; seq_lens [B]."""
    batch, kv_heads, group, head_dim = q.shape
    block_size = k_cache.shape[2]
    for job in numba.prange(batch * kv_heads):
        b = job // kv_heads
        h = job - b * kv_heads
        length = seq_lens[b]
        acc = np.zeros((group, head_dim), np.float32)
        running_max = np.full(group, -np.inf, np.float32)
        denom = np.zeros(group, np.float32)
        scores = np.empty(block_size, np.float32)
        queries = np.empty((group, head_dim), np.float32)
        for g in range(group):
            for x in range(head_dim):
                queries[g, x] = q[b, h, g, x] * scale
        for j in range((length + block_size - 1) // block_size):
            block = block_tables[b, j]
            count = min(block_size, length - j * block_size)
            keys = k_cache[h, block]
            values = v_cache[h, block]
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
                total = denom[g] * rescale
                for x in range(head_dim):
                    acc[g, x] *= rescale
                running_max[g] = top
                for t in range(count):
                    weight = np.exp(scores[t] - top)
                    total += weight
                    for x in range(head_dim):
                        acc[g, x] += weight * values[t, x]
                denom[g] = total
        for g in range(group):
            inverse = np.float32(1.0) / denom[g] if denom[g] > 0 else np.float32(0.0)
            for x in range(head_dim):
                out[b, h, g, x] = acc[g, x] * inverse


def _compile():
    options = {"parallel": True, "fastmath": True, "nogil": True}
    try:
        return numba.njit(cache=True, **options)(_decode_kernel)
    except RuntimeError as err:  # no writable place for numba's cache (a read-only image): compile at every start
        log.info("numba cannot cache the CPU decode kernel (%s); it compiles at start instead", err)
        return numba.njit(**options)(_decode_kernel)


_kernel = _compile()
# numba's default thread pool ("workqueue") must not be entered from two threads at once: engines that share a
# process take turns.
_launch = threading.Lock()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence); k_cache, v_cache [KVH, num_blocks, block_size * D];
    block_tables [B, W] (padding beyond a sequence's blocks is never read); seq_lens [B] tokens to attend to.
    Returns [B, H, D]."""
    batch, heads, head_dim = q.shape
    kv_heads, num_blocks = k_cache.shape[0], k_cache.shape[1]
    queries = q.contiguous().view(batch, kv_heads, heads // kv_heads, head_dim)
    out = torch.empty_like(queries)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    with _launch:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        _kernel(queries.numpy(), k_cache.view(shape).numpy(), v_cache.view(shape).numpy(),
                block_tables.numpy(), seq_lens.numpy(), np.float32(scale), out.numpy())
    return out.view(batch, heads, head_dim)
