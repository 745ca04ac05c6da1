"""The attention-backend interface and its plain-torch implementation over the paged KV cache.

A backend owns the KV cache tensors (one preallocated pool of blocks per layer) and computes
attention for a ragged batch: decode sequences (one new token each) come first in the batch,
then prefill chunks, each attending to its cached context and causally within itself.
The Triton implementation (for GPUs) is in triton_attention.py.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    """Decode sequences [start, end) of the batch, attended together; padded only to the group's longest."""

    start: int
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] padded with block 0
    seq_lens: torch.Tensor  # [n] tokens in the cache after this step's write
    block_size: int
    dtype: torch.dtype  # of the mask

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[n, max_blocks * block_size] additive: 0 to attend, -inf beyond each seq_len. Built on first use (the
        torch backend's padded attention); the Triton kernels read seq_lens and never build it."""
        width = self.block_tables.shape[1] * self.block_size
        beyond = torch.arange(width, device=self.seq_lens.device)[None, :] >= self.seq_lens[:, None]
        return torch.zeros(beyond.shape, dtype=self.dtype, device=self.seq_lens.device).masked_fill_(
            beyond, float("-inf"))


@dataclass
class AttentionMetadata:
    """Where a step's tokens sit: built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block * block_size + offset) of each new token
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token sequences, sorted by length
    decode_groups: list[DecodeGroup]  # consecutive runs of decode sequences of similar length
    prefill_query_lens: list[int]  # per prefill sequence: its new tokens
    prefill_context_lens: list[int]  # per prefill sequence: tokens already in the cache before this chunk
    prefill_block_tables: list[torch.Tensor]  # per prefill sequence: its blocks
    _prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def prefill_mask(self, index: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[q_len, ctx_len + q_len] additive mask of prefill sequence `index` over its cached context and its own
        chunk (0 to attend, -inf after the query's position). Built on its first layer and kept for the step's
        others; an additive mask in the queries' dtype runs torch's CPU attention ~10 % faster than a boolean one,
        which it converts at every call."""
        mask = self._prefill_masks.get(index)
        if mask is None:
            ctx_len, q_len = self.prefill_context_lens[index], self.prefill_query_lens[index]
            positions = torch.arange(ctx_len + q_len, device=device)
            hidden = positions[None, :] > positions[ctx_len:, None]
            mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._prefill_masks[index] = mask
        return mask


class AttentionBackend:
    """Owns the paged KV cache; subclasses compute attention over it in `forward`."""

    # Blocks one decode group may span (its sequences x its longest block table); see ModelRunner.
    decode_group_blocks: int

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None

    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # [layer, k/v, kv_head, block, slot-in-block * head_dim]: one block of one head is a contiguous row.
        self.kv_cache = torch.zeros(
            self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size * self.head_dim,
            dtype=self.dtype, device=self.device,
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] for the step's new tokens; returns [T, H * D]."""
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Paged attention on the CPU: decode reads the blocks in place (numba, kernels/cpu_decode_attention.py) for float32
    and bfloat16; prefill with context and other dtypes gather blocks whole, so copies move 4 KiB rows, not tokens."""

    # Gathering: big enough to amortize the calls, small enough that the gathered K/V (x kv heads x 2) is still in
    # cache when attention reads it. In place: one group, since the kernel reads each sequence's own length.
    decode_group_blocks = 256

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_layers, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        self.decode_in_place = None
        if device.type == "cpu":
            from kvfleet.kernels import cpu_decode_attention  # numba: imported when used

            if dtype in cpu_decode_attention.CACHE_DTYPES:
                self.decode_in_place = cpu_decode_attention.paged_decode_attention
                self.decode_group_blocks = sys.maxsize

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] for the step's new tokens; returns [T, H * D]."""
        k_cache, v_cache = self.kv_cache[layer]
        self._write(k_cache, k, meta.slot_mapping)
        self._write(v_cache, v, meta.slot_mapping)
        outputs = []
        for group in meta.decode_groups:
            outputs.append(self._decode(q[group.start:group.end], k_cache, v_cache, group))
        start = meta.num_decode_tokens
        for index, (q_len, ctx_len, table) in enumerate(zip(meta.prefill_query_lens, meta.prefill_context_lens,
                                                            meta.prefill_block_tables, strict=True)):
            end = start + q_len
            mask = meta.prefill_mask(index, q.dtype, q.device) if ctx_len else None
            outputs.append(self._prefill(q[start:end], k[start:end], v[start:end], ctx_len, table,
                                         k_cache, v_cache, mask))
            start = end
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _write(self, cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        flat = cache.view(self.num_kv_heads, -1, self.head_dim)
        flat.index_copy_(1, slot_mapping, new.transpose(0, 1))

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[KVH, n_blocks * block_size, D] for the given blocks, in order."""
        return cache.index_select(1, block_ids).view(self.num_kv_heads, -1, self.head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                group: DecodeGroup) -> torch.Tensor:
        if self.decode_in_place is not None:
            return self.decode_in_place(q, k_cache, v_cache, group.block_tables, group.seq_lens, self.block_size,
                                          self.scale)
        batch = q.shape[0]
        tables = group.block_tables.flatten()
        length = group.block_tables.shape[1] * self.block_size
        keys = self._gather(k_cache, tables).view(self.num_kv_heads, batch, length, self.head_dim).transpose(0, 1)
        values = self._gather(v_cache, tables).view(self.num_kv_heads, batch, length, self.head_dim).transpose(0, 1)
        # the query heads that share a KV head as rows of one query (grouped-query attention without repeating the
        # keys for each head: 20 % less time than SDPA's enable_gqa here)
        group_size = self.num_heads // self.num_kv_heads
        queries = q.view(batch, self.num_kv_heads, group_size, self.head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask[:, None, None, :],
                                             scale=self.scale)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int,
                 table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill chunk: causal within itself when nothing is cached before it, else over its gathered
        context under `mask` (AttentionMetadata.prefill_mask)."""
        queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if ctx_len == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            total = ctx_len + q.shape[0]
            keys = self._gather(k_cache, table)[:, :total]
            values = self._gather(v_cache, table)[:, :total]
        out = F.scaled_dot_product_attention(
            queries, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, is_causal=ctx_len == 0,
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)  # [q_len, H, D]
