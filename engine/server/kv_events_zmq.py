"""The engine's KV events in vLLM's wire format, for routers that subscribe to vLLM pods (vllm-router's kv_aware,
llm-d, Dynamo): a ZMQ PUB socket sends `[topic, seq as 8-byte big-endian, msgpack batch]` per batch, seq from 0 in
this process; a ROUTER socket replays the buffered batches from a requested seq, then `[b"", -1 as 8 bytes, b""]`.

A batch is vLLM's KVEventBatch (msgspec, array_like): `[ts, [event, ...], data_parallel_rank]`, each event a tagged
map as vLLM >= 0.11 sends it. The publisher is fed by a KVEventHub subscription on the server's event loop, so its
first batch restates the cache (AllBlocksCleared, then every block held); if it ever falls behind the hub, it
subscribes again and publishes the fresh snapshot. The replay buffer is bounded in batches and bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field

import msgpack
import zmq
import zmq.asyncio

from kvfleet.engine.kv_event_hub import KVEventHub, Subscription, TooManySubscribers
from kvfleet.fleet.kv_events import EventBatch, event_dict

log = logging.getLogger("kvfleet.engine")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # vLLM's default
MAX_BUFFER_BYTES = 64 << 20
HWM = 100_000
REPLAY_YIELD_EVERY = 256  # replayed messages between yields: a replay never holds the event loop long
DATA_PARALLEL_RANK = 0


def encode_batch(batch: EventBatch, rank: int = DATA_PARALLEL_RANK) -> bytes:
    """A batch as vLLM's msgspec encoder lays it out: array-like envelope, tagged-map events with every field
    that has no default (lora_id, medium, lora_name) present even when null."""
    return msgpack.packb([batch.ts, [event_dict(event) for event in batch.events], rank])


@dataclass
class ZmqKVEventPublisher:
    """PUB + replay ROUTER bound on `host`; port 0 takes free ports, which /kv_event_sources then reports."""

    hub: KVEventHub
    host: str
    port: int
    topic: str = ""
    buffer_steps: int = BUFFER_STEPS
    hwm: int = HWM
    endpoint: str = field(init=False, default="")
    replay_endpoint: str = field(init=False, default="")
    published: int = field(init=False, default=0)
    _buffer: deque[tuple[int, bytes]] = field(init=False, default_factory=deque)
    _buffer_bytes: int = field(init=False, default=0)
    _tasks: list[asyncio.Task] = field(init=False, default_factory=list)
    _context: zmq.asyncio.Context | None = field(init=False, default=None)

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, 64)  # a replay request is 8 bytes; anything big drops its peer
        self.endpoint = _bind(pub, self.host, self.port)
        self.replay_endpoint = _bind(router, self.host, self.port + 1 if self.port else 0)
        self._tasks = [asyncio.create_task(self._publish(pub), name="kv events zmq pub"),
                       asyncio.create_task(self._serve_replays(router), name="kv events zmq replay")]
        log.info("KV events in vLLM's format: PUB %s, replay %s", self.endpoint, self.replay_endpoint)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def sources(self, advertised_host: str) -> dict:
        """vLLM's /kv_event_sources body: one source per data-parallel rank (this engine has one)."""
        return {str(DATA_PARALLEL_RANK): {
            "enable_kv_cache_events": True, "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
            "endpoint": _advertised(self.endpoint, advertised_host),
            "replay_endpoint": _advertised(self.replay_endpoint, advertised_host),
            "buffer_steps": self.buffer_steps, "hwm": self.hwm, "max_queue_size": self.buffer_steps,
            "topic": self.topic}}

    async def _publish(self, pub: zmq.asyncio.Socket) -> None:
        topic, seq = self.topic.encode(), 0
        while True:
            try:
                sub: Subscription = self.hub.subscribe()
            except TooManySubscribers:  # SSE subscribers hold every slot: try again shortly
                await asyncio.sleep(1.0)
                continue
            try:
                while (batch := await sub.queue.get()) is not None:
                    payload = encode_batch(batch)
                    frame = seq.to_bytes(8, "big")
                    await pub.send_multipart((topic, frame, payload))
                    self._remember(seq, payload)
                    seq += 1
                    self.published = seq
            finally:
                self.hub.unsubscribe(sub)
            log.info("the ZMQ KV-event publisher's subscription ended (it fell behind, or the engine drains); "
                     "publishing a fresh snapshot")

    def _remember(self, seq: int, payload: bytes) -> None:
        self._buffer.append((seq, payload))
        self._buffer_bytes += len(payload)
        while self._buffer and (len(self._buffer) > self.buffer_steps or self._buffer_bytes > MAX_BUFFER_BYTES):
            self._buffer_bytes -= len(self._buffer.popleft()[1])

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        topic = self.topic.encode()
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request (vLLM's layout: identity, empty delimiter, 8-byte start seq)
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for sent, (seq, payload) in enumerate([item for item in self._buffer if item[0] >= start], 1):
                await router.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"), payload))
                if sent % REPLAY_YIELD_EVERY == 0:
                    await asyncio.sleep(0)
            await router.send_multipart((identity, b"", b"", END_SEQ, b""))


def _bind(socket: zmq.asyncio.Socket, host: str, port: int) -> str:
    address = f"[{host}]" if ":" in host else host
    if host in ("", "0.0.0.0", "::"):
        address = "*"
    if port:
        socket.bind(f"tcp://{address}:{port}")
        return f"tcp://{address}:{port}"
    chosen = socket.bind_to_random_port(f"tcp://{address}")
    return f"tcp://{address}:{chosen}"


def _advertised(endpoint: str, host: str) -> str:
    """A wildcard bind names no host a subscriber can dial: name the one the asker reached this engine by."""
    if not endpoint.startswith("tcp://*:") or not host:
        return endpoint
    return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"


@dataclass
class VllmKVEvents:
    """What vLLM's discovery routes report: this engine's block size and its ZMQ publisher (None: off)."""

    block_size: int = 16
    publisher: ZmqKVEventPublisher | None = None
    instance_id: str = field(default_factory=lambda: f"kvfleet-{uuid.uuid4().hex[:12]}")

    async def start(self) -> None:
        if self.publisher is not None:
            try:
                await self.publisher.start()
            except zmq.ZMQError as err:  # a taken port: the engine serves on, without this publisher
                log.error("cannot publish KV events over ZMQ on %s port %s: %s; choose a free "
                          "--kv-events-zmq-port", self.publisher.host, self.publisher.port, err)
                with contextlib.suppress(Exception):
                    await self.publisher.stop()
                self.publisher = None

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.stop()
