"""The precise prefix index: for each engine, which token blocks its prefix cache holds, fed only by its KV events.

Engines name blocks with their own hashes (opaque here, random per engine process); the index keys a block by a
chain over its token ids instead (after llm-d's and vllm-router's indexes), so a prompt the gateway tokenizes finds
its blocks on every engine whatever they call them. An event whose parent block is unknown (evicted, or stored
before the stream's snapshot) cannot be keyed and is dropped: the engine cannot use such a block for a prefix hit
either, since its lookups walk the chain from the first block. Memory is bounded per engine; an engine's entries go
when it leaves the pool or its stream restarts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvfleet.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

MAX_BLOCKS_PER_ENGINE = 262_144  # ~50 MiB per engine at worst; far above any engine's cache (1 GiB: ~1.4k blocks)


def _root(block_size: int) -> bytes:
    return b"kvfleet-kv-index/" + block_size.to_bytes(4, "big")


def chain_keys(token_ids: list[int] | tuple[int, ...], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Keys of the full blocks of token_ids, chained from `parent` (None: from the start of a prompt)."""
    keys, previous = [], parent if parent is not None else _root(block_size)
    ids = array("I", token_ids)
    for start in range(0, len(ids) - block_size + 1, block_size):
        previous = hashlib.blake2b(previous + ids[start:start + block_size].tobytes(), digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclass
class EngineBlocks:
    """One engine's blocks: its name for each -> our key."""

    keys: dict[int, bytes]
    dropped: int = 0  # stored blocks whose parent was unknown


class KVIndex:
    def __init__(self, max_blocks_per_engine: int = MAX_BLOCKS_PER_ENGINE) -> None:
        self.max_blocks_per_engine = max_blocks_per_engine
        self._engines: dict[str, EngineBlocks] = {}
        self._holders: dict[bytes, set[str]] = {}  # our key -> engines holding it
        self.block_sizes: dict[str, int] = {}  # engine -> its block size (from its events)

    def engines(self) -> list[str]:
        return list(self._engines)

    def size(self, url: str) -> int:
        blocks = self._engines.get(url)
        return len(blocks.keys) if blocks else 0

    def reset(self, url: str) -> None:
        """Start an engine over (its stream restarted; a snapshot follows)."""
        self.forget(url)
        self._engines[url] = EngineBlocks({})

    def forget(self, url: str) -> None:
        blocks = self._engines.pop(url, None)
        self.block_sizes.pop(url, None)
        if blocks is not None:
            for key in blocks.keys.values():
                self._release(key, url)

    def apply(self, url: str, events: Iterable[KVEvent]) -> None:
        blocks = self._engines.setdefault(url, EngineBlocks({}))
        for event in events:
            if isinstance(event, BlockStored):
                self._store(url, blocks, event)
            elif isinstance(event, BlockRemoved):
                for name in event.block_hashes:
                    key = blocks.keys.pop(name, None)
                    if key is not None:
                        self._release(key, url)
            elif isinstance(event, AllBlocksCleared):
                self.reset(url)
                blocks = self._engines[url]

    def _store(self, url: str, blocks: EngineBlocks, event: BlockStored) -> None:
        if event.lora_name is not None or event.lora_id is not None:  # an adapter's KV: no plain request uses it
            return
        parent = None
        if event.parent_block_hash is not None:
            parent = blocks.keys.get(event.parent_block_hash)
            if parent is None:
                blocks.dropped += len(event.block_hashes)
                return
        self.block_sizes[url] = event.block_size
        for name, key in zip(event.block_hashes, chain_keys(event.token_ids, event.block_size, parent), strict=True):
            old = blocks.keys.get(name)
            if old is not None and old != key:
                self._release(old, url)
            blocks.keys[name] = key
            self._holders.setdefault(key, set()).add(url)
        while len(blocks.keys) > self.max_blocks_per_engine:  # the oldest first: a misbehaving stream stays bounded
            self._release(blocks.keys.pop(next(iter(blocks.keys))), url)

    def _release(self, key: bytes, url: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._holders[key]

    def matched_blocks(self, keys_by_size: Mapping[int, list[bytes]]) -> dict[str, int]:
        """For each engine, how many of the prompt's leading blocks it holds in one run from the first."""
        out: dict[str, int] = {}
        for size, keys in keys_by_size.items():
            alive: set[str] = set()
            count = 0
            for key in keys:
                holders = self._holders.get(key)
                if not holders:
                    break
                if not count:
                    alive = {u for u in holders if self.block_sizes.get(u) == size}
                elif not alive <= holders:  # most blocks keep the same holders: no new set then
                    left = alive & holders
                    for url in alive - left:
                        out[url] = count
                    alive = left
                if not alive:
                    break
                count += 1
            for url in alive:
                out[url] = count
        return out
