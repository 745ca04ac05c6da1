"""KV cache events: which prefix-cache blocks an engine stored and evicted, in the shape of vLLM's KV events.

An engine names a full block by a 64-bit hash chained over its tokens and its parent block (vLLM's int block hashes);
the names are the engine's own and opaque to subscribers, who key blocks by the token ids the events carry. One
message is a batch: `{"seq": n, "ts": unix seconds, "events": [...], "snapshot": bool}`; `seq` counts the engine's
messages from 0, so a gap means something was lost; a snapshot message starts with AllBlocksCleared and restates
every block held. Events are vLLM's tagged maps:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": int | null, "token_ids": [...],
     "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

`medium` "GPU" names the engine's primary KV tier, as vLLM's does, whatever the device. A block computed for a LoRA
adapter names it in `lora_name` (vLLM >= 0.11) and carries the engine's id of the adapter in `lora_id` (the older
field, deprecated by vLLM, which older routers check): its KV is that adapter's, and no request of the base model or
another adapter can use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KV_EVENTS_PATH = "/kv_events"  # the engine's SSE stream of these messages (an engine API key guards it)
MEDIUM = "GPU"
MAX_BLOCK_SIZE = 1024
MAX_LORA_NAME = 256
MAX_BLOCKS_PER_EVENT = 65_536
MAX_EVENTS_PER_MESSAGE = 65_536
HASH_BITS = 64


class KVEventError(ValueError):
    """A message that is not a KV-event batch; the subscriber drops the connection and starts over."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None  # the adapter whose KV these blocks hold (None: the base model)
    lora_id: int | None = None  # the engine's id of that adapter's registration


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    snapshot: bool = False


def block_name(digest: bytes) -> int:
    """The 64-bit name events give a block whose full hash is `digest` (its first 8 bytes)."""
    return int.from_bytes(digest[:8], "big")


def event_dict(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": event.lora_id, "medium": MEDIUM,
                "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> str:
    return json.dumps({"seq": batch.seq, "ts": batch.ts, "events": [event_dict(e) for e in batch.events],
                       "snapshot": batch.snapshot}, separators=(",", ":"))


def decode_batch(text: str | bytes) -> EventBatch:
    """A message from an engine's stream; KVEventError for anything else (the stream is not trusted to be sane)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise KVEventError(f"a KV-event message is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise KVEventError("a KV-event message must be an object")
    seq, ts, events = data.get("seq"), data.get("ts", 0.0), data.get("events")
    if not _is_int(seq) or seq < 0 or not isinstance(ts, int | float) or not isinstance(events, list):
        raise KVEventError("a KV-event message needs seq (a count), ts (seconds) and events (a list)")
    if len(events) > MAX_EVENTS_PER_MESSAGE:
        raise KVEventError(f"a KV-event message carries at most {MAX_EVENTS_PER_MESSAGE} events")
    return EventBatch(seq, float(ts), tuple(parse_event(e) for e in events), data.get("snapshot") is True)


def parse_event(raw: object) -> KVEvent:
    """One event as a tagged map (vLLM >= 0.11) or a positional array (earlier vLLM: the tag first)."""
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        raw = _from_array(raw)
    if not isinstance(raw, dict):
        raise KVEventError("a KV event must be an object with a type")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(raw.get("block_hashes"))
    if kind == "BlockRemoved":
        return BlockRemoved(hashes)
    if kind != "BlockStored":
        raise KVEventError(f"unknown KV event type {str(kind)[:40]!r}")
    size, parent, tokens = raw.get("block_size"), raw.get("parent_block_hash"), raw.get("token_ids")
    if not _is_int(size) or not 0 < size <= MAX_BLOCK_SIZE:
        raise KVEventError(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}]")
    if parent is not None:
        parent = _hash(parent)
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * size or not all(map(_is_token, tokens)):
        raise KVEventError("token_ids must be block_size non-negative integers per stored block")
    lora = raw.get("lora_name")
    if lora is not None and (not isinstance(lora, str) or not 0 < len(lora) <= MAX_LORA_NAME):
        raise KVEventError(f"lora_name must be null or a name of 1 to {MAX_LORA_NAME} characters")
    lora_id = raw.get("lora_id")
    if lora_id is not None and not (_is_int(lora_id) and 0 <= lora_id < 1 << 63):
        raise KVEventError("lora_id must be null or a non-negative integer")
    return BlockStored(hashes, parent, tuple(tokens), size, lora, lora_id)


def _from_array(raw: list | tuple) -> dict:
    fields = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
              "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}.get(raw[0])
    if fields is None:
        raise KVEventError(f"unknown KV event type {raw[0][:40]!r}")
    return {"type": raw[0], **dict(zip(fields, raw[1:], strict=False))}


def _hashes(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple) or not raw or len(raw) > MAX_BLOCKS_PER_EVENT:
        raise KVEventError(f"block_hashes must list 1 to {MAX_BLOCKS_PER_EVENT} hashes")
    return tuple(_hash(h) for h in raw)


def _hash(raw: object) -> int:
    """A block hash as an int: vLLM sends 64-bit ints (signed or not) or, without int hashes, digest bytes."""
    if isinstance(raw, bytes | bytearray) and 0 < len(raw) <= 64:
        return int.from_bytes(raw, "big")
    if _is_int(raw) and -(1 << (HASH_BITS - 1)) <= raw < (1 << HASH_BITS):
        return raw
    raise KVEventError("a block hash must be a 64-bit integer or up to 64 bytes")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: object) -> bool:
    return _is_int(value) and 0 <= value < 1 << 32
