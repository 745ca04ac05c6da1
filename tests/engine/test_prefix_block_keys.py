"""A prefix-cache hit is always the same tokens: block keys are SHA-256 digests chained over token ids.

Python's hash() maps 0 and sys.hash_info.modulus (2**61 - 1) to the same value, so blocks named by hash() of their
token tuples collided and one prompt could be served another prompt's KV; digests over the token bytes do not.
"""

from __future__ import annotations

import os
import sys

from hypothesis import assume, given
from hypothesis import strategies as st

from kvfleet.engine.block_manager import BlockManager, block_key
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence

COLLIDES_WITH_ZERO = sys.hash_info.modulus  # hash(2**61 - 1) == hash(0) on 64-bit builds


def admit_and_compute(bm: BlockManager, tokens: list[int], request_id: str) -> Sequence:
    seq = Sequence(request_id, list(tokens), SamplingParams(max_tokens=1))
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - bm.cached_prefix_tokens(cached), cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_blocks_that_collide_under_python_hash_never_share_kv() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = [0, 0, 0, 0, 7]
    other = [COLLIDES_WITH_ZERO, 0, 0, 0, 7]
    assert hash(tuple(first[:4])) == hash(tuple(other[:4])), "the premise: these blocks collide under hash()"
    admit_and_compute(bm, first, "first")

    same = Sequence("same", list(first), SamplingParams(max_tokens=1))
    assert bm.cached_prefix_tokens(bm.find_cached_prefix(same)) == 4, "the same tokens hit the cache"
    colliding = Sequence("other", list(other), SamplingParams(max_tokens=1))
    assert bm.find_cached_prefix(colliding) == [], "a different prompt was given the first prompt's KV"


BLOCKS = st.lists(st.sampled_from([0, 1, -1, -2, COLLIDES_WITH_ZERO]) | st.integers(-2**63, 2**63 - 1),
                  min_size=1, max_size=16)


@given(BLOCKS, BLOCKS, st.binary(min_size=32, max_size=32))
def test_different_token_blocks_get_different_32_byte_keys(a: list[int], b: list[int], parent: bytes) -> None:
    assume(a != b)
    key_a, key_b = block_key(parent, a), block_key(parent, b)
    assert len(key_a) == len(key_b) == 32
    assert key_a != key_b
    assert block_key(parent, a) == key_a, "a key is a pure function of the parent and the tokens"


def test_a_block_key_names_everything_before_it() -> None:
    root = os.urandom(32)
    block = [5, 6, 7, 8]
    assert block_key(block_key(root, [1, 2, 3, 4]), block) != block_key(block_key(root, [4, 3, 2, 1]), block)
