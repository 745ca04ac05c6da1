"""The attention backend on Triton kernels (kvfleet.kernels): what the engine runs on GPUs.

Imported only when chosen, since it imports triton; on CPU it runs in Triton's interpreter (tests).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata
from kvfleet.kernels.decode_attention import paged_decode_attention
from kvfleet.kernels.kv_cache_write import write_kv_cache
from kvfleet.kernels.prefill_attention import prefill_attention


@dataclass
class PrefillBatch:
    """The step's prefill chunks as the prefill kernel takes them."""

    block_tables: torch.Tensor  # [S, max_blocks] padded with block 0
    query_starts: torch.Tensor  # [S + 1] offsets of each chunk within the prefill tokens
    context_lens: torch.Tensor  # [S]
    max_query_len: int


def build_prefill_batch(meta: AttentionMetadata, device: torch.device) -> PrefillBatch:
    starts = [0]
    for query_len in meta.prefill_query_lens:
        starts.append(starts[-1] + query_len)
    return PrefillBatch(
        block_tables=pad_sequence(meta.prefill_block_tables, batch_first=True),
        query_starts=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(meta.prefill_context_lens, dtype=torch.long, device=device),
        max_query_len=max(meta.prefill_query_lens),
    )


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels: the cache is read in place through block tables, never gathered."""

    # Nothing is gathered, so all decode sequences go to one kernel launch.
    decode_group_blocks = sys.maxsize

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_layers, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        # Every layer sees the same metadata in a step: its prefill tensors are built once, on the first layer.
        self._prefill_for: AttentionMetadata | None = None
        self._prefill: PrefillBatch | None = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] for the step's new tokens; returns [T, H * D]."""
        k_cache, v_cache = self.kv_cache[layer]
        write_kv_cache(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            paged_decode_attention(q[group.start:group.end], k_cache, v_cache, group.block_tables, group.seq_lens,
                                   self.scale, out=out[group.start:group.end])
        if meta.prefill_query_lens:
            batch = self._prefill_batch(meta)
            start = meta.num_decode_tokens
            prefill_attention(q[start:], k_cache, v_cache, batch.block_tables, batch.query_starts,
                              batch.context_lens, batch.max_query_len, self.scale, out=out[start:])
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _prefill_batch(self, meta: AttentionMetadata) -> PrefillBatch:
        if self._prefill_for is not meta:
            self._prefill_for, self._prefill = meta, build_prefill_batch(meta, self.device)
        return self._prefill
