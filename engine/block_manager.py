"""Paged KV cache bookkeeping: a pool of fixed-size blocks, reference counts and prefix caching.

After vLLM v1's block pool: a full block is named by a hash chain over its tokens and every
token before it, so two requests with the same prefix share those blocks. A block whose last
owner finished goes back to the free queue but keeps its hash, so it can still be hit until
it is handed out again; the free queue hands out least recently freed blocks first. Block hashes are
SHA-256 digests chained over token ids, as vLLM's are, so a hit is the same tokens, never a hash() collision.
A request of a LoRA adapter starts its chain from a root of its own (the adapter's registration): its blocks hold
that adapter's KV, and only requests of the same adapter hit them.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kvfleet.engine.sequence import Sequence
from kvfleet.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, block_name

# A random root per process: no prompt can be crafted offline to share another's block hashes.
_HASH_ROOT = os.urandom(32)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Owns which sequence holds which KV block; never touches the tensors themselves."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        # what the prefix cache stored and evicted since take_events(), when someone listens (engine/kv_event_hub.py)
        self.events: list[KVEvent] | None = None

    def clear(self) -> None:
        """Forget every cached block (the KV cache is released: sleep mode). Only while no sequence holds a block."""
        if self.num_free_blocks != self.num_blocks:
            raise RuntimeError("blocks are held: the cache is cleared only while no request runs")
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events or []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold the longest cached prefix of seq (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        found: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def blocks_filled_by(self, seq: Sequence, num_new_tokens: int) -> list[bytes]:
        """The hashes of the prompt blocks that seq's next num_new_tokens complete (none without prefix caching)."""
        if not self.enable_prefix_caching or num_new_tokens <= 1:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min((seq.num_computed_tokens + num_new_tokens) // self.block_size, len(seq.block_hashes))
        return seq.block_hashes[first:last]

    def next_uncached_block(self, seq: Sequence, cached_prefix: list[int]) -> bytes | None:
        """The hash of the first full prompt block of a waiting seq after its cached prefix (find_cached_prefix),
        or None where its prompt has no such block."""
        index = len(cached_prefix)
        return seq.block_hashes[index] if self.enable_prefix_caching and index < len(seq.block_hashes) else None

    def cached_prefix_tokens(self, cached_prefix: list[int]) -> int:
        """How many leading tokens of the prompt the cached prefix blocks (from find_cached_prefix) hold."""
        return len(cached_prefix) * self.block_size

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] | None = None) -> bool:
        """Whether allocate() would succeed now."""
        return self._new_blocks(seq, num_new_tokens, cached_prefix or []) is not None

    def _new_blocks(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int]) -> int | None:
        """Fresh blocks seq needs for num_new_tokens more tokens after cached_prefix; None if they are not free."""
        num_tokens = seq.num_computed_tokens + self.cached_prefix_tokens(cached_prefix) + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_prefix)
        reclaimed = sum(1 for block_id in cached_prefix if self.blocks[block_id].ref_count == 0)
        return None if num_new_blocks > self.num_free_blocks - reclaimed else num_new_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] | None = None) -> bool:
        """Give seq blocks for num_new_tokens more tokens, after an optional cached prefix; False if they don't fit."""
        cached_prefix = cached_prefix or []
        num_new_blocks = self._new_blocks(seq, num_new_tokens, cached_prefix)
        if num_new_blocks is None:
            return False
        for block_id in cached_prefix:
            self._take(block_id)
            seq.block_table.append(block_id)
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._take_fresh())
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; freed tail blocks are evicted before freed head blocks."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that seq has filled and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        hashes = self._block_hashes(seq, num_full)
        stored: list[int] = []
        for index in range(num_full):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and hashes[index] not in self.cached_blocks:
                block.block_hash = hashes[index]
                self.cached_blocks[hashes[index]] = block.block_id
                stored.append(index)
        if stored and self.events is not None:
            self._record_stored(seq, hashes, stored)

    def _record_stored(self, seq: Sequence, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks, naming the block before the run as its parent."""
        size, start = self.block_size, 0
        for i in range(1, len(stored) + 1):
            if i < len(stored) and stored[i] == stored[i - 1] + 1:
                continue
            first, last = stored[start], stored[i - 1]
            self.events.append(BlockStored(
                tuple(block_name(h) for h in hashes[first:last + 1]),
                block_name(hashes[first - 1]) if first else None,
                tuple(seq.token_ids_slice(first * size, (last + 1) * size)), size,
                None if seq.lora is None else seq.lora.name, None if seq.lora is None else seq.lora.id))
            start = i

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved((block_name(block.block_hash),)))
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain over seq's first num_blocks full blocks, extending seq.block_hashes as needed."""
        hashes = seq.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else chain_root(seq)
            hashes.append(block_key(parent, seq.token_ids_slice(index * size, (index + 1) * size)))
        return hashes


def chain_root(seq: Sequence) -> bytes:
    """Where a sequence's hash chain starts: the process's root, or its adapter's own root derived from it."""
    if seq.lora is None:
        return _HASH_ROOT
    return hashlib.sha256(_HASH_ROOT + b"lora" + seq.lora.id.to_bytes(8, "big") + seq.lora.name.encode()).digest()


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """A full block's name: SHA-256 over its parent's name and its token ids (as 64-bit integers)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
