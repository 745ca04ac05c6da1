"""Shared by the property tests: a model of what each KV block holds, to catch a sequence reading another's KV."""

from __future__ import annotations

from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.sequence import Sequence


def write_kv(bm: BlockManager, contents: dict[int, list], seq: Sequence, n: int) -> None:
    """Record that seq's next n tokens were written; a shared or cached block must already hold the same tokens."""
    size = bm.block_size
    tokens = seq.all_token_ids
    for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
        block_id = seq.block_table[pos // size]
        block = bm.blocks[block_id]
        slot = contents[block_id]
        if block.ref_count > 1 or block.block_hash is not None:
            assert slot[pos % size] == tokens[pos], f"{seq.request_id} overwrote shared block {block_id}"
        slot[pos % size] = tokens[pos]
