"""An engine streams its prefix cache's block events (GET /kv_events, vLLM's BlockStored / BlockRemoved /
AllBlocksCleared): a subscriber first gets a snapshot of every block held, then each block stored and evicted, in
numbered batches; the stream needs the engine token when one is set, and ends when the engine drains."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from kvfleet.fleet.kv_events import AllBlocksCleared
from tests.conftest import _engine_args, _launch, _wait_ready, free_port, start_engine_server, stop_process
from tests.support.kv_event_stream import EventStream

BLOCK = 16
# ~25 blocks of the tiny model's KV (768 bytes a token): a few prompts evict the first ones
SMALL_CACHE = ("--kv-cache-memory", "300KiB", "--max-num-seqs", "4")


def prompt(n: int, first: int) -> list[int]:
    return list(range(first, first + n))


def complete(url: str, token_ids: list[int], headers: dict | None = None) -> None:
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": token_ids, "max_tokens": 2}, headers=headers,
                       timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    proc, url = start_engine_server(tiny_model_dir, *SMALL_CACHE)
    yield url
    stop_process(proc)


def test_a_prompts_full_blocks_are_reported_stored_with_their_tokens_then_removed_when_evicted(engine: str) -> None:
    stream = EventStream(engine)
    try:
        first = stream.wait_for(lambda s: s.batches[:1])[0]
        assert first.snapshot and isinstance(first.events[0], AllBlocksCleared)
        tokens = prompt(70, 1000)
        complete(engine, tokens)
        stored = stream.wait_for(lambda s: [e for e in s.stored() if e.token_ids[:BLOCK] == tuple(tokens[:BLOCK])])
        event = stored[0]
        assert event.parent_block_hash is None and event.block_size == BLOCK
        assert event.token_ids == tuple(tokens[:len(event.block_hashes) * BLOCK])
        assert len(event.block_hashes) == 4, "70 prompt tokens + 1 computed output fill 4 blocks of 16"
        seqs = [b.seq for b in stream.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "batches are numbered without gaps"

        for i in range(8):  # other prompts: the cache (~25 blocks) evicts the first prompt's blocks
            complete(engine, prompt(70, 5000 + 100 * i))
        names = set(event.block_hashes)
        stream.wait_for(lambda s: names <= s.removed())
    finally:
        stream.close()


def test_a_new_subscriber_starts_from_a_snapshot_of_the_blocks_held(engine: str) -> None:
    tokens = prompt(40, 20_000)
    complete(engine, tokens)
    stream = EventStream(engine)
    try:
        snapshot = stream.wait_for(lambda s: s.batches[:1])[0]
        assert snapshot.snapshot
        held = [e for e in snapshot.events[1:]]
        assert any(e.token_ids[:BLOCK] == tuple(tokens[:BLOCK]) and e.parent_block_hash is None for e in held)
        seen: set[int] = set()
        for e in held:  # parents come before their children, so a subscriber can key every block
            assert e.parent_block_hash is None or e.parent_block_hash in seen
            seen.update(e.block_hashes)
        complete(engine, prompt(40, 30_000))
        later = stream.wait_for(lambda s: s.batches[1:])
        assert later[0].seq == snapshot.seq + 1 and not later[0].snapshot
    finally:
        stream.close()


def test_the_stream_needs_the_engine_token_and_ends_when_the_engine_drains(tiny_model_dir: Path) -> None:
    token = "kv-events-token"
    port = free_port()
    os.environ["KVFLEET_ENGINE_API_KEY"] = token
    try:
        proc = _launch(_engine_args(tiny_model_dir, port, SMALL_CACHE), port, "engine")
    finally:
        del os.environ["KVFLEET_ENGINE_API_KEY"]
    try:
        _wait_ready(proc, 180.0)
        refused = httpx.get(proc.url + "/kv_events", timeout=5)
        assert refused.status_code == 401 and "Bearer" in refused.json()["error"]["message"]
        stream = EventStream(proc.url, {"Authorization": f"Bearer {token}"})
        stream.wait_for(lambda s: s.batches[:1])
        assert stream.status == 200
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        assert stream.ended.wait(5)
        assert time.monotonic() - started < 8, "an open event stream held the engine's drain"
    finally:
        stop_process(proc)


def test_an_engine_without_kv_events_says_so(tiny_model_dir: Path) -> None:
    proc, url = start_engine_server(tiny_model_dir, "--no-kv-events")
    try:
        reply = httpx.get(url + "/kv_events", timeout=5)
        assert reply.status_code == 404 and "--no-kv-events" in reply.json()["error"]["message"]
    finally:
        stop_process(proc)
