"""The block manager never double-books a block, leaks one, or hands a sequence a cached block holding other tokens.

A stateful test drives BlockManager's API directly (admit with a prefix-cache lookup, grow, compute, free) against a
model of what it should do: reference counts from the live sequences, the free queue as a least-recently-freed list,
and the tokens a fake model wrote into each block.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence
from tests.support.kv_sim import write_kv

TOKENS = st.integers(0, 3)  # a small vocabulary, so unrelated prompts also share blocks now and then


def random_tokens(seed: int, length: int) -> list[int]:
    """Prompt text from a seed: a long random list would use up hypothesis' data budget."""
    rng = random.Random(seed)
    return [rng.randrange(4) for _ in range(length)]


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=1))


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the engine does after the model ran num_tokens more of seq's tokens."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, growth, computation and frees, checked against a model after every call."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_blocks=st.integers(1, 8),
        prefix_caching=st.booleans() | st.just(True),
        data=st.data(),
    )
    def setup(self, block_size: int, num_blocks: int, prefix_caching: bool, data: st.DataObject) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.capacity = num_blocks * block_size
        self.live: list[Sequence] = []
        self.free_order = list(range(num_blocks))  # the model of the free queue, least recently freed first
        self.contents: dict[int, list[int | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.prefix_of_hash: dict[bytes, tuple[int, ...]] = {}  # block hash -> every token up to the end of its block
        seeds = data.draw(st.lists(st.integers(0, 2**16), min_size=1, max_size=2), label="shared prefix seeds")
        self.prefixes = [random_tokens(seed, self.capacity) for seed in seeds]
        self.next_id = 0

    # --- helpers ------------------------------------------------------------------------------------------------

    def _draw_prompt(self, data: st.DataObject) -> list[int]:
        size = self.bm.block_size
        boundaries = list(range(size, self.capacity + 1, size))
        length = data.draw(st.integers(1, self.capacity) | st.sampled_from(boundaries), label="prompt length")
        prefix = data.draw(st.sampled_from(self.prefixes), label="prefix")
        shared = data.draw(st.just(length) | st.integers(0, length), label="shared length")
        tail_seed = data.draw(st.integers(0, 2**16), label="tail seed")
        return prefix[:shared] + random_tokens(tail_seed, length - shared)

    def _snapshot(self) -> tuple:
        return (
            list(self.bm.free_queue),
            [(b.ref_count, b.block_hash) for b in self.bm.blocks],
            dict(self.bm.cached_blocks),
        )

    def _expected_hits(self, seq: Sequence) -> int:
        """How many leading full blocks of seq the cache holds, judged by content, leaving one token to compute."""
        if not self.bm.enable_prefix_caching:
            return 0
        cached = {self.prefix_of_hash[h] for h in self.bm.cached_blocks}
        tokens = seq.all_token_ids
        size = self.bm.block_size
        hits = 0
        while hits < (seq.num_tokens - 1) // size and tuple(tokens[:(hits + 1) * size]) in cached:
            hits += 1
        return hits

    def _take_fresh_in_model(self, count: int) -> list[int]:
        taken, self.free_order = self.free_order[:count], self.free_order[count:]
        return taken

    def _record_hashes(self, seq: Sequence) -> None:
        tokens = seq.all_token_ids
        size = self.bm.block_size
        for index, block_id in enumerate(seq.block_table):
            block_hash = self.bm.blocks[block_id].block_hash
            if block_hash is not None:
                prefix = tuple(tokens[:(index + 1) * size])
                named = self.prefix_of_hash.setdefault(block_hash, prefix)
                assert named == prefix, f"block hash {block_hash} names two different token prefixes"

    def _choose(self, data: st.DataObject, seqs: list[Sequence]) -> Sequence:
        return seqs[data.draw(st.integers(0, len(seqs) - 1), label="sequence")]

    # --- rules --------------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        seq = make_seq(self._draw_prompt(data), f"r{self.next_id}")
        self.next_id += 1
        size = self.bm.block_size
        cached = self.bm.find_cached_prefix(seq)
        assert len(cached) == len(set(cached))
        assert len(cached) == self._expected_hits(seq), "the prefix cache missed (or invented) a cached block"
        for index, block_id in enumerate(cached):
            assert self.contents[block_id] == seq.all_token_ids[index * size:(index + 1) * size], (
                f"cache hit on block {block_id} would give {seq.request_id} another prompt's KV"
            )
        assert self.bm.cached_prefix_tokens(cached) == len(cached) * size, "cached tokens are whole blocks"
        num_new = data.draw(st.integers(1, seq.num_tokens - len(cached) * size), label="tokens to allocate")
        needed = self.bm.blocks_needed(len(cached) * size + num_new) - len(cached)
        reclaimable = [b for b in self.free_order if b not in cached]
        before = self._snapshot()
        ok = self.bm.allocate(seq, num_new, cached)
        assert ok == (needed <= len(reclaimable))
        if not ok:
            assert self._snapshot() == before and seq.block_table == [], "a failed allocate must change nothing"
            return
        self.free_order = [b for b in self.free_order if b not in cached]
        fresh = self._take_fresh_in_model(needed)
        assert seq.block_table == cached + fresh, "fresh blocks must come least recently freed first"
        for block_id in fresh:
            assert self.bm.blocks[block_id].block_hash is None
            assert block_id not in self.bm.cached_blocks.values(), "an evicted block is still named in the cache"
        seq.num_computed_tokens = len(cached) * size
        self.live.append(seq)

    @precondition(lambda self: any(s.num_new_tokens > 0 for s in self.live))
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        seq = self._choose(data, [s for s in self.live if s.num_new_tokens > 0])
        num_new = data.draw(st.integers(1, seq.num_new_tokens), label="tokens to allocate")
        needed = max(self.bm.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_table), 0)
        table = list(seq.block_table)
        before = self._snapshot()
        ok = self.bm.allocate(seq, num_new)
        assert ok == (needed <= len(self.free_order))
        if not ok:
            assert self._snapshot() == before and seq.block_table == table, "a failed allocate must change nothing"
            return
        assert seq.block_table == table + self._take_fresh_in_model(needed)

    @precondition(lambda self: any(self._uncomputed_with_blocks(s) > 0 for s in self.live))
    @rule(data=st.data())
    def compute_tokens(self, data: st.DataObject) -> None:
        seq = self._choose(data, [s for s in self.live if self._uncomputed_with_blocks(s) > 0])
        count = data.draw(st.integers(1, self._uncomputed_with_blocks(seq)), label="tokens computed")
        write_kv(self.bm, self.contents, seq, count)
        compute(self.bm, seq, count)
        self._record_hashes(seq)
        if seq.num_computed_tokens == seq.num_tokens and seq.num_tokens < self.capacity:
            seq.output_token_ids.append(data.draw(TOKENS, label="sampled token"))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self._choose(data, self.live)
        for block_id in reversed(seq.block_table):
            if self.bm.blocks[block_id].ref_count == 1:
                self.free_order.append(block_id)
        self.bm.free(seq)
        assert seq.block_table == []
        self.live = [s for s in self.live if s is not seq]

    def _uncomputed_with_blocks(self, seq: Sequence) -> int:
        return min(len(seq.block_table) * self.bm.block_size, seq.num_tokens) - seq.num_computed_tokens

    # --- invariants ---------------------------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_owners(self) -> None:
        owners = Counter(block_id for seq in self.live for block_id in seq.block_table)
        for seq in self.live:
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq.request_id} holds a block twice"
        for block in self.bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == owners[block.block_id], f"block {block.block_id}: ref count vs owners"

    @invariant()
    def free_queue_is_exactly_the_unowned_blocks_in_lru_order(self) -> None:
        used = sum(1 for block in self.bm.blocks if block.ref_count > 0)
        assert self.bm.num_free_blocks + used == self.bm.num_blocks
        assert set(self.bm.free_queue) == {b.block_id for b in self.bm.blocks if b.ref_count == 0}
        assert list(self.bm.free_queue) == self.free_order

    @invariant()
    def prefix_cache_names_match_contents(self) -> None:
        size = self.bm.block_size
        for block_hash, block_id in self.bm.cached_blocks.items():
            assert self.bm.blocks[block_id].block_hash == block_hash
            assert self.contents[block_id] == list(self.prefix_of_hash[block_hash][-size:])
        for block in self.bm.blocks:
            if block.block_hash is not None:
                assert self.bm.cached_blocks.get(block.block_hash) == block.block_id, "stale block hash"

    @invariant()
    def every_sequence_sees_its_own_kv(self) -> None:
        size = self.bm.block_size
        for seq in self.live:
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens):
                assert self.contents[seq.block_table[pos // size]][pos % size] == tokens[pos], (
                    f"{seq.request_id} position {pos} reads another sequence's KV"
                )


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# --- examples that read as documentation ----------------------------------------------------------------------------


def admit_and_compute(bm: BlockManager, tokens: list[int], request_id: str = "r") -> Sequence:
    seq = make_seq(tokens, request_id)
    cached = bm.find_cached_prefix(seq)
    cached_tokens = bm.cached_prefix_tokens(cached)
    assert bm.allocate(seq, seq.num_tokens - cached_tokens, cached)
    seq.num_computed_tokens = cached_tokens
    compute(bm, seq, seq.num_tokens - cached_tokens)
    return seq


def test_freed_blocks_stay_cached_until_handed_out_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    first = admit_and_compute(bm, [1, 2, 3, 4])
    assert first.block_table == [0, 1]
    bm.free(first)
    # Never-used blocks were freed longest ago; of first's blocks the tail goes before the head.
    assert list(bm.free_queue) == [2, 3, 1, 0]
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 9])) == [0, 1], "freed blocks are still a cache hit"

    other = make_seq([7, 7, 7, 7, 7, 7])
    assert bm.allocate(other, 6)
    assert other.block_table == [2, 3, 1], "least recently freed first, and first's tail before its head"
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 9])) == [0], "block 1 was handed out, so only 0 still hits"
    assert 1 not in bm.cached_blocks.values()


def test_block_aligned_identical_prompt_still_computes_its_last_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit_and_compute(bm, list(range(8)), "a")
    again = make_seq(list(range(8)), "b")
    assert len(bm.find_cached_prefix(again)) == 1, "the last token must be computed to get logits"
    longer = make_seq(list(range(9)), "c")
    assert len(bm.find_cached_prefix(longer)) == 2


def test_partly_filled_block_is_never_shared() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit_and_compute(bm, [5, 5, 5, 5, 6, 6], "a")
    assert len(bm.cached_blocks) == 1
    assert len(bm.find_cached_prefix(make_seq([5, 5, 5, 5, 6, 6, 1, 2, 3], "b"))) == 1


def test_allocate_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    holder = admit_and_compute(bm, [1, 2, 3])
    free_before = list(bm.free_queue)
    big = make_seq([9] * 6)
    assert not bm.allocate(big, 6)
    assert big.block_table == [] and list(bm.free_queue) == free_before
    assert [b.ref_count for b in bm.blocks] == [1, 1, 0]
    assert holder.block_table == [0, 1]


def test_shared_prefix_block_is_freed_only_by_its_last_owner() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = admit_and_compute(bm, [1, 2, 3], "a")
    b = admit_and_compute(bm, [1, 2, 4], "b")
    assert a.block_table[0] == b.block_table[0] and bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(a)
    assert a.block_table == [] and bm.blocks[b.block_table[0]].ref_count == 1
    assert b.block_table[0] not in bm.free_queue
    bm.free(b)
    assert bm.num_free_blocks == 4
