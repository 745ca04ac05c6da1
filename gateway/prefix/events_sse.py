"""Follow every engine's KV-event stream (GET /kv_events, Server-Sent Events) into the precise prefix index.

One loop per engine in the pool, as the scraper has. A stream starts with a snapshot; a gap in the batches' seq, a
malformed message or a silent connection (no keepalive for a while) ends it, the engine's entries are dropped (its
prompts fall back to the approximate table) and the loop reconnects after a growing pause, for a fresh snapshot.
An engine without the stream (404) is followed over ZMQ if it names vLLM-format sources on /kv_event_sources (a
vLLM pod: gateway/prefix/events_zmq.py); one that publishes neither is asked again only every minute.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from kvfleet.fleet.headers import AUTHORIZATION
from kvfleet.fleet.kv_events import KV_EVENTS_PATH, EventBatch, KVEventError, decode_batch
from kvfleet.gateway.engines.loops import PerEngineLoops
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.events_zmq import ZmqEventSubscriber
from kvfleet.gateway.prefix.kv_index import KVIndex

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # a snapshot of the largest index the gateway keeps per engine fits
SILENCE_S = 15.0  # engines send a keepalive every 5 s
RETRY_S = (0.5, 1.0, 2.0, 5.0)
NOT_PUBLISHING_RETRY_S = 60.0


class StreamEnded(Exception):
    pass


class KVEventFollower:
    def __init__(self, pool: EndpointPool, index: KVIndex, metrics: GatewayMetrics,
                 engine_api_key: str | None = None) -> None:
        self.pool, self.index, self.metrics = pool, index, metrics
        self.headers = {AUTHORIZATION: f"Bearer {engine_api_key}"} if engine_api_key else {}
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=SILENCE_S),
            cookie_jar=aiohttp.DummyCookieJar())
        self._loops = PerEngineLoops(self._loop, "kv events", on_leave=index.forget)
        self.zmq = ZmqEventSubscriber(index, metrics)

    def sync(self) -> None:
        """Follow each new engine; stop following (and forget) those that left."""
        self._loops.sync(self.pool.endpoints)

    async def stop(self) -> None:
        await self._loops.stop()
        await self.session.close()
        self.zmq.close()

    async def _loop(self, url: str) -> None:
        failures = 0
        while url in self.pool.endpoints:
            pause = RETRY_S[min(failures, len(RETRY_S) - 1)]
            try:
                pause = await self.follow(url) or pause
                failures = 0
            except (aiohttp.ClientError, TimeoutError, KVEventError, StreamEnded) as err:
                if failures == 0:
                    log.info("KV events of %s: %s; reconnecting", url, err or type(err).__name__)
                failures += 1
            finally:
                self.index.forget(url)
                self.metrics.labelled(self.metrics.kv_index_blocks, url).set(0)
            await asyncio.sleep(pause)

    async def follow(self, url: str) -> float | None:
        """Apply one stream's batches until it ends; the pause before the next try when the engine has none."""
        async with self.session.get(url + KV_EVENTS_PATH, headers=self.headers) as response:
            if response.status == 404:
                response.release()
                return await self._follow_zmq(url)
            if response.status != 200:
                raise StreamEnded(f"{KV_EVENTS_PATH} answered {response.status}")
            expected: int | None = None
            buffer = bytearray()
            async for chunk in response.content.iter_any():
                searched = max(0, len(buffer) - 1)
                buffer += chunk
                while (end := buffer.find(b"\n\n", searched)) >= 0:
                    batch = _data(bytes(buffer[:end]))
                    del buffer[:end + 2]
                    searched = 0
                    if batch is not None:
                        expected = self._apply(url, batch, expected)
                if len(buffer) > MAX_MESSAGE_BYTES:
                    raise StreamEnded(f"a message over {MAX_MESSAGE_BYTES} bytes")
        raise StreamEnded("the stream closed")

    async def _follow_zmq(self, url: str) -> float:
        """An engine without /kv_events may publish vLLM's format over ZMQ (a vLLM pod): follow that instead."""
        if await self.zmq.follow(self.session, url, self.headers, lambda: self._reachable(url)):
            return RETRY_S[0]
        return NOT_PUBLISHING_RETRY_S

    def _reachable(self, url: str) -> bool:
        """Whether the engine still answers its scrapes (one that does not may have died, and its cache with it)."""
        state = self.pool.endpoints.get(url)
        return state is not None and state.scrape_error is None

    def _apply(self, url: str, batch: EventBatch, expected: int | None) -> int:
        if batch.snapshot:
            self.index.reset(url)
        elif expected is None or batch.seq != expected:
            raise StreamEnded(f"batch {batch.seq} arrived where {expected} was due")
        self.index.apply(url, batch.events)
        if not batch.snapshot:
            self.metrics.kv_event_lag.observe(max(0.0, time.time() - batch.ts))
        self.metrics.labelled(self.metrics.kv_index_blocks, url).set(self.index.size(url))
        return batch.seq + 1


def _data(message: bytes) -> EventBatch | None:
    """The batch in one SSE message (its data lines); None for a comment (keepalive)."""
    data = [line[5:].lstrip(b" ") for line in message.split(b"\n") if line.startswith(b"data:")]
    return decode_batch(b"\n".join(data)) if data else None
