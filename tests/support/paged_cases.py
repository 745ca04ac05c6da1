"""Paged batches for the kernel tests: random caches, and block tables sharing prefix blocks as prefix caching does."""

from __future__ import annotations

import torch

HEAD_DIMS = (64, 128)
QUERIES_PER_KV_HEAD = (1, 3, 8)  # 3: SmolLM2's grouped-query attention
BLOCK_SIZES = (16, 32)
CONTEXT_LENS = (1, 15, 16, 17, 257)


def kv_heads_for(queries_per_kv_head: int) -> int:
    """Few heads keep the interpreter quick; two KV heads where the group is small, to cover the head offset."""
    return 2 if queries_per_kv_head < 8 else 1


def random_caches(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools, [KVH, blocks, block_size * D], full of random values."""
    shape = (num_kv_heads, num_blocks, block_size * head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def block_tables_for(lengths: list[int], block_size: int, shared_prefix_blocks: int = 0) -> torch.Tensor:
    """[S, W] tables padded with block 0. Blocks are scattered at random (a wrong lookup reads wrong values);
    every sequence longer than the shared prefix starts with the same shared_prefix_blocks blocks."""
    needed = [-(-n // block_size) for n in lengths]
    pool = (torch.randperm(sum(needed) + shared_prefix_blocks) + 1).tolist()
    shared, pool = pool[:shared_prefix_blocks], pool[shared_prefix_blocks:]
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.long)
    for i, (length, count) in enumerate(zip(lengths, needed, strict=True)):
        prefix = shared if length > shared_prefix_blocks * block_size else []
        own, pool = pool[: count - len(prefix)], pool[count - len(prefix):]
        tables[i, :count] = torch.tensor(prefix + own)
    return tables


def num_blocks_for(tables: torch.Tensor) -> int:
    return int(tables.max()) + 1


def decode_case(lengths: list[int], block_size: int, head_dim: int, num_kv_heads: int, group: int,
                shared_prefix_blocks: int = 0, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's inputs: q [S, KVH * group, D], the K and V pools, block tables and seq_lens [S]."""
    tables = block_tables_for(lengths, block_size, shared_prefix_blocks)
    k_cache, v_cache = random_caches(num_kv_heads, num_blocks_for(tables), block_size, head_dim, dtype)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths)
