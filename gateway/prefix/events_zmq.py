"""Follow a pod that publishes KV events only in vLLM's wire format (a vLLM pod, or a kvfleet engine with
--no-kv-events-sse) into the precise prefix index.

Discovery is vLLM's: `GET /kv_event_sources` names the ZMQ PUB endpoint (and a replay ROUTER endpoint) of each
data-parallel rank; the lowest rank is followed. Frames are `[topic, seq (8 bytes, big-endian), msgpack batch]`; a
batch is `[ts, [event, ...], data_parallel_rank?]`, events tagged maps or (older vLLM) tagged arrays. A gap in seq
is filled from the replay socket; what it cannot fill drops the pod's entries and goes on from the batch at hand
(blocks whose parent was lost are then not keyed, as KVIndex does); seq going back means the pod restarted. Only the
pod's primary tier without a LoRA adapter counts (`medium` null or "GPU", no lora): other blocks serve no plain
prompt from GPU memory. Every frame is hostile: malformed ones are skipped, sizes are capped before decoding.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from kvfleet.fleet.kv_events import MAX_EVENTS_PER_MESSAGE, KVEvent, KVEventError, parse_event
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.kv_index import KVIndex

log = logging.getLogger(__name__)

KV_EVENT_SOURCES_PATH = "/kv_event_sources"
MAX_SOURCES_BYTES = 64 << 10
MAX_FRAME_BYTES = 64 << 20
MAX_ARRAY_LEN = 1 << 22  # token ids of one event at most (65,536 blocks of 64 tokens)
# While the stream is quiet: how often to ask whether the pod is still reachable (a dead pod's blocks are gone).
REACHABLE_CHECK_S = 1.0
REDISCOVER_S = 30.0  # vLLM sends nothing while idle: ask again now and then whether the endpoints moved
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAYED = 20_000  # vLLM buffers 10,000 batches by default
END_SEQ = -1
_PRIMARY_MEDIA = (None, "GPU")
_MEDIUM_AT = {"BlockStored": 6, "BlockRemoved": 2}  # its position in an older vLLM's tagged array
_LORA_AT = {"BlockStored": 5}


@dataclass(frozen=True)
class ZmqSource:
    endpoint: str
    replay_endpoint: str | None
    topic: bytes


def decode_vllm_batch(payload: bytes) -> tuple[float, tuple[KVEvent, ...]]:
    """A msgpack KVEventBatch as vLLM publishes it: (ts, events of the primary tier); KVEventError otherwise."""
    if len(payload) > MAX_FRAME_BYTES:
        raise KVEventError("a KV-event batch over the size limit")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_str_len=1 << 16, max_bin_len=64,
                               max_array_len=MAX_ARRAY_LEN, max_map_len=64, max_ext_len=0)
    except Exception as err:  # noqa: BLE001 - msgpack raises ValueError, TypeError and its own on garbage
        raise KVEventError(f"a KV-event batch is not msgpack: {type(err).__name__}") from None
    if not isinstance(data, list) or len(data) not in (2, 3):
        raise KVEventError("a KV-event batch must be [ts, events] or [ts, events, data_parallel_rank]")
    ts, events = data[0], data[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise KVEventError("a KV-event batch needs ts (seconds) and events (a list)")
    if len(events) > MAX_EVENTS_PER_MESSAGE:
        raise KVEventError(f"a KV-event batch carries at most {MAX_EVENTS_PER_MESSAGE} events")
    return float(ts), tuple(parse_event(e) for e in events if _on_primary_tier(e))


def _on_primary_tier(raw: object) -> bool:
    if isinstance(raw, dict):
        return raw.get("medium") in _PRIMARY_MEDIA and raw.get("lora_id") is None and raw.get("lora_name") is None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        medium, lora = _MEDIUM_AT.get(raw[0], len(raw)), _LORA_AT.get(raw[0], len(raw))
        return (raw[medium] if medium < len(raw) else None) in _PRIMARY_MEDIA and (
            raw[lora] if lora < len(raw) else None) is None
    return True  # parse_event says what is wrong with it


def parse_sources(body: object, engine_url: str) -> ZmqSource | None:
    """The lowest rank's ZMQ source in a /kv_event_sources body (vLLM has answered `{"0": {...}}`, a list, and
    `{"sources": [...]}`); a wildcard host becomes the engine's own."""
    if isinstance(body, dict) and isinstance(body.get("sources"), list):
        body = body["sources"]
    if isinstance(body, dict):
        entries = [(rank, entry) for rank, entry in body.items() if rank.isascii() and rank.isdigit() and len(rank) < 6]
        entries = [entry for _, entry in sorted(entries, key=lambda item: int(item[0]))]
    elif isinstance(body, list):
        entries = sorted((e for e in body if isinstance(e, dict)),
                         key=lambda e: e.get("data_parallel_rank") if isinstance(e.get("data_parallel_rank"),
                                                                                 int) else 0)
    else:
        return None
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    for entry in entries[:64]:
        if not isinstance(entry, dict) or entry.get("enable_kv_cache_events") is False:
            continue
        if entry.get("publisher", "zmq") != "zmq":
            continue
        endpoint, replay, topic = entry.get("endpoint"), entry.get("replay_endpoint"), entry.get("topic") or ""
        if not _is_tcp(endpoint) or not isinstance(topic, str) or len(topic) > 256:
            continue
        return ZmqSource(_dialable(endpoint, host), _dialable(replay, host) if _is_tcp(replay) else None,
                         topic.encode())
    return None


def _is_tcp(endpoint: object) -> bool:
    return (isinstance(endpoint, str) and len(endpoint) < 512 and endpoint.startswith("tcp://")
            and endpoint.rpartition(":")[2].isascii() and endpoint.rpartition(":")[2].isdigit())


def _dialable(endpoint: str, engine_host: str) -> str:
    host, _, port = endpoint[6:].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        host = f"[{engine_host}]" if ":" in engine_host else engine_host
    return f"tcp://{host}:{port}"


def _frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a live `[topic, seq, payload]` message; None for anything else."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


class ZmqEventSubscriber:
    """Follows one pod at a time per call to `follow`; the caller (KVEventFollower) runs one loop per pod."""

    def __init__(self, index: KVIndex, metrics: GatewayMetrics) -> None:
        self.index, self.metrics = index, metrics
        self.context = zmq.asyncio.Context()

    def close(self) -> None:
        self.context.destroy(linger=0)

    async def discover(self, session: aiohttp.ClientSession, url: str, headers: dict) -> ZmqSource | None:
        async with session.get(url + KV_EVENT_SOURCES_PATH, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=5.0)) as response:
            if response.status != 200:
                return None
            raw = await response.content.read(MAX_SOURCES_BYTES + 1)
        if len(raw) > MAX_SOURCES_BYTES:
            return None
        try:
            return parse_sources(json.loads(raw), url)
        except ValueError:
            return None

    async def follow(self, session: aiohttp.ClientSession, url: str, headers: dict,
                     reachable: Callable[[], bool] = lambda: True) -> bool:
        """Apply the pod's ZMQ batches until its sources move or it stops being `reachable` (its scrapes fail: a
        pod that died took its cache with it); False when it names none."""
        source = await self.discover(session, url, headers)
        if source is None:
            return False
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic)
        try:
            sub.connect(source.endpoint)
            log.info("KV events of %s: following vLLM's ZMQ stream %s", url, source.endpoint)
            self.index.reset(url)
            self._set_size(url)
            expected, last_live = await self._replay(url, source, 0), -1
            asked_at = time.monotonic()
            while True:
                try:
                    async with asyncio.timeout(REACHABLE_CHECK_S):
                        frames = await sub.recv_multipart()
                except TimeoutError:
                    if not reachable():
                        log.info("KV events of %s: the pod is unreachable; forgetting its blocks", url)
                        return True
                    if time.monotonic() - asked_at >= REDISCOVER_S:
                        if await self.discover(session, url, headers) != source:
                            return True  # moved or gone: the caller starts over
                        asked_at = time.monotonic()
                    continue
                message = _frames(frames)
                if message is not None:
                    expected = await self._on_batch(url, source, *message, expected, last_live)
                    if expected > message[0]:  # applied (a malformed batch leaves its seq due: a resend may come)
                        last_live = message[0]
        except zmq.ZMQError as err:  # an endpoint ZMQ cannot dial, from the pod's own discovery answer
            raise KVEventError(f"cannot follow {source.endpoint[:80]!r}: {err}") from None
        finally:
            sub.close(linger=0)

    async def _on_batch(self, url: str, source: ZmqSource, seq: int, payload: bytes, expected: int,
                        last_live: int) -> int:
        """Apply a live batch in order; the seq due next. Live batches come in order, so one numbered at or below
        the last live one means a restarted publisher; below `expected` alone, a replay already applied it."""
        if seq <= last_live:
            log.info("KV events of %s: seq went back from %d to %d; the pod restarted", url, last_live, seq)
            self.index.reset(url)
            expected = 0
        elif seq < expected:
            return expected
        if seq > expected:
            expected = await self._replay(url, source, expected)
        if seq > expected:  # lost for good
            log.info("KV events of %s: batches %d to %d lost; starting over", url, expected, seq - 1)
            self.index.reset(url)
            expected = seq
        if seq == expected and self._apply(url, payload):
            return seq + 1
        return expected

    async def _replay(self, url: str, source: ZmqSource, start: int) -> int:
        """Apply the pod's buffered batches from `start` on; the seq due next."""
        if source.replay_endpoint is None:
            return start
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        dealer.connect(source.replay_endpoint)
        expected = start
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            for _ in range(MAX_REPLAYED + 1):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    frames = await dealer.recv_multipart()
                message = _frames(frames[1:]) if frames and frames[0] == b"" else None
                if message is None:
                    continue
                seq, payload = message
                if seq == END_SEQ:
                    break
                if seq > expected:  # the pod's buffer no longer holds what came before
                    self.index.reset(url)
                    expected = seq
                if seq == expected and self._apply(url, payload):
                    expected += 1
        except TimeoutError:
            log.info("KV events of %s: replay from %d did not finish in %ss", url, start, REPLAY_TIMEOUT_S)
        finally:
            dealer.close(linger=0)
        return expected

    def _apply(self, url: str, payload: bytes) -> bool:
        try:
            ts, events = decode_vllm_batch(payload)
        except KVEventError as err:
            log.debug("KV events of %s: skipped a malformed batch: %s", url, err)
            return False
        self.index.apply(url, events)
        if 0 < ts <= time.time() + 60:
            self.metrics.kv_event_lag.observe(max(0.0, time.time() - ts))
        self._set_size(url)
        return True

    def _set_size(self, url: str) -> None:
        self.metrics.labelled(self.metrics.kv_index_blocks, url).set(self.index.size(url))
