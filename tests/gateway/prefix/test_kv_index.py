"""The gateway's precise prefix index (gateway/prefix/kv_index.py) and the KV-event messages it is fed: blocks keyed by
their tokens whatever the engine calls them, an engine's longest run from the prompt's start, evictions and departures
forgotten, memory bounded, and every malformed message refused with KVEventError rather than a crash."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet.engine.kv_event_hub import KVEventHub
from kvfleet.fleet.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventError,
    decode_batch,
    encode_batch,
)
from kvfleet.gateway.prefix.kv_index import KVIndex, chain_keys

PROMPT = list(range(100, 164))  # 4 blocks of 16


def stored(names: list[int], tokens: list[int], parent: int | None = None, size: int = 16) -> BlockStored:
    return BlockStored(tuple(names), parent, tuple(tokens), size)


def test_an_engines_blocks_are_found_by_their_tokens_whatever_it_names_them() -> None:
    index = KVIndex()
    index.apply("a", [stored([11, 12], PROMPT[:32]), stored([13], PROMPT[32:48], parent=12)])
    index.apply("b", [stored([901], PROMPT[:16])])
    assert index.matched_blocks({16: chain_keys(PROMPT, 16)}) == {"a": 3, "b": 1}
    assert index.matched_blocks({16: chain_keys(list(range(7, 71)), 16)}) == {}


def test_a_removed_block_ends_the_run_and_a_departed_engine_holds_nothing() -> None:
    index = KVIndex()
    index.apply("a", [stored([1, 2, 3], PROMPT[:48])])
    index.apply("b", [stored([7, 8, 9], PROMPT[:48])])
    index.apply("a", [BlockRemoved((2,))])
    assert index.matched_blocks({16: chain_keys(PROMPT, 16)}) == {"a": 1, "b": 3}
    index.forget("b")
    index.apply("a", [AllBlocksCleared()])
    assert index.matched_blocks({16: chain_keys(PROMPT, 16)}) == {} and index.size("a") == 0


def test_a_block_whose_parent_is_unknown_is_dropped_as_the_engine_could_not_hit_it_either() -> None:
    index = KVIndex()
    index.apply("a", [stored([5], PROMPT[16:32], parent=4)])
    assert index.size("a") == 0 and index.matched_blocks({16: chain_keys(PROMPT, 16)}) == {}


def test_an_engine_with_another_block_size_is_not_matched_on_keys_of_this_size() -> None:
    index = KVIndex()
    index.apply("a", [stored([1], PROMPT[:32], size=32)])
    assert index.matched_blocks({16: chain_keys(PROMPT, 16)}) == {}
    assert index.matched_blocks({32: chain_keys(PROMPT, 32)}) == {"a": 1}


def test_an_engine_that_never_removes_anything_cannot_grow_the_index_past_its_bound() -> None:
    index = KVIndex(max_blocks_per_engine=100)
    for i in range(1000):
        index.apply("a", [stored([i], [i] * 16)])
    assert index.size("a") == 100
    assert index.matched_blocks({16: chain_keys([999] * 16, 16)}) == {"a": 1}, "the newest blocks are kept"


@pytest.mark.parametrize("message", [
    "not json", "[]", '{"seq": -1, "events": []}', '{"seq": true, "events": []}', '{"seq": 1, "events": {}}',
    '{"seq": 1, "events": [{"type": "Nope"}]}', '{"seq": 1, "events": [42]}',
    '{"seq": 1, "events": [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 16}]}',
    '{"seq": 1, "events": [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 1}]}',
    '{"seq": 1, "events": [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}]}',
    '{"seq": 1, "events": [{"type": "BlockRemoved", "block_hashes": []}]}',
    '{"seq": 1, "events": [{"type": "BlockRemoved", "block_hashes": [1e30]}]}',
    '{"seq": 1, "events": [{"type": "BlockRemoved", "block_hashes": [' + ",".join(["1"] * 70_000) + ']}]}',
])
def test_a_malformed_message_is_refused_with_kv_event_error(message: str) -> None:
    with pytest.raises(KVEventError):
        decode_batch(message)


def test_older_vllm_positional_events_and_signed_hashes_are_understood() -> None:
    batch = decode_batch(json.dumps({"seq": 3, "ts": 1.5, "events": [
        ["BlockStored", [-5, 6], None, list(range(32)), 16, None], ["BlockRemoved", [-5]], ["AllBlocksCleared"]]}))
    assert batch.events == (BlockStored((-5, 6), None, tuple(range(32)), 16), BlockRemoved((-5,)), AllBlocksCleared())


def test_a_snapshot_lists_every_parent_before_its_children_and_round_trips() -> None:
    async def scenario() -> EventBatch:
        hub = KVEventHub()
        hub.publish([stored([1, 2], PROMPT[:32])])
        hub.publish([BlockRemoved((1,))])
        hub.publish([stored([1], PROMPT[:16])])  # the parent is stored again after its child
        return (await hub.subscribe().queue.get())

    snapshot = decode_batch(encode_batch(asyncio.run(scenario())))
    assert snapshot.snapshot and snapshot.seq == 3 and isinstance(snapshot.events[0], AllBlocksCleared)
    index = KVIndex()
    index.apply("a", snapshot.events)
    assert index.matched_blocks({16: chain_keys(PROMPT, 16)}) == {"a": 2}


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 5), st.integers(1, 6)), max_size=30),
       st.integers(0, 5), st.integers(1, 6))
def test_every_engines_run_is_the_longest_prefix_of_the_prompt_it_holds(stores, first, length) -> None:
    """Against a brute-force reference: engines store runs of blocks (tenant `t`'s first n blocks)."""
    index = KVIndex()
    held: dict[str, set[bytes]] = {}
    for url, tenant, n in stores:
        tokens = [tenant * 1000 + i for i in range(16 * n)]
        index.apply(url, [stored([hash((url, tenant, i)) for i in range(n)], tokens)])
        held.setdefault(url, set()).update(chain_keys(tokens, 16))
    prompt_keys = chain_keys([first * 1000 + i for i in range(16 * length)], 16)
    expected = {}
    for url, keys in held.items():
        run = next((i for i, k in enumerate(prompt_keys) if k not in keys), len(prompt_keys))
        if run:
            expected[url] = run
    assert index.matched_blocks({16: prompt_keys}) == expected
