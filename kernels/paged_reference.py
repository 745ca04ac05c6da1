"""Plain-torch building blocks of the kernels' references: gather a sequence's context, attend in float32."""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, head_dim: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from a cache [KVH, blocks, block_size * D]: [KVH, length, D]."""
    blocks = cache[:, block_table.long()]  # [KVH, n_blocks, block_size * D]
    return blocks.reshape(cache.shape[0], -1, head_dim)[:, :length]


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
           first_position: int) -> torch.Tensor:
    """Causal attention of queries [n, H, D] at positions first_position.. over keys/values [KVH, L, D]."""
    group = queries.shape[1] // keys.shape[0]
    keys = keys.float().repeat_interleave(group, dim=0)
    values = values.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hld->hnl", queries.float(), keys) * scale
    positions = first_position + torch.arange(queries.shape[0], device=queries.device)
    future = torch.arange(keys.shape[1], device=queries.device)[None, :] > positions[:, None]
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnl,hld->nhd", weights, values).to(queries.dtype)
