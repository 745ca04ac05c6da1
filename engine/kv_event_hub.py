"""The engine's KV-event hub: numbers the block manager's events, keeps the prefix cache as they describe it, and
hands each batch to every subscriber; a new subscriber first gets a snapshot of every block held.

The engine thread publishes (one batch per step with events); subscribers live on event loops. One lock orders a
subscription against the batches, so a subscriber sees the snapshot at seq n, then batches n+1, n+2, ... A
subscriber that falls `max_queued` batches behind is cut off (its stream ends) and starts over from a snapshot:
no subscriber can make the engine hold memory for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

from kvfleet.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

MAX_SUBSCRIBERS = 64
MAX_QUEUED = 4096  # batches (engine steps) a subscriber may lag before it is cut off


class TooManySubscribers(RuntimeError):
    pass


class Subscription:
    """One subscriber's queue of batches on its event loop; None in it means cut off."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_queued: int) -> None:
        self.loop, self.max_queued = loop, max_queued
        self.queue: asyncio.Queue[EventBatch | None] = asyncio.Queue()
        self.cut_off = False

    def end(self) -> None:
        if not self.cut_off:
            self.cut_off = True
            self.queue.put_nowait(None)

    def offer(self, batch: EventBatch) -> None:
        if self.cut_off:
            return
        if self.queue.qsize() >= self.max_queued:
            self.cut_off = True
            self.queue.put_nowait(None)
        else:
            self.queue.put_nowait(batch)


class KVEventHub:
    def __init__(self, max_subscribers: int = MAX_SUBSCRIBERS, max_queued: int = MAX_QUEUED) -> None:
        self.max_subscribers, self.max_queued = max_subscribers, max_queued
        self._lock = threading.Lock()
        # name -> (parent, tokens, size, (adapter name, adapter id))
        self._blocks: dict[int, tuple[int | None, tuple[int, ...], int, tuple[str | None, int | None]]] = {}
        self._seq = 0
        self._subscribers: set[Subscription] = set()

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, events: Iterable[KVEvent]) -> None:
        """From any thread: apply and number a batch, and queue it for every subscriber."""
        events = tuple(events)
        if not events:
            return
        with self._lock:
            for event in events:
                self._apply(event)
            self._seq += 1
            batch = EventBatch(self._seq, time.time(), events)
            subscribers = list(self._subscribers)
        for sub in subscribers:
            try:
                sub.loop.call_soon_threadsafe(sub.offer, batch)
            except RuntimeError:  # its loop has closed: the server is stopping
                self.unsubscribe(sub)

    def subscribe(self) -> Subscription:
        """On the subscriber's event loop: a subscription whose first batch is the snapshot."""
        sub = Subscription(asyncio.get_running_loop(), self.max_queued)
        with self._lock:
            if len(self._subscribers) >= self.max_subscribers:
                raise TooManySubscribers(f"this engine already streams KV events to {self.max_subscribers} "
                                         "subscribers; retry later or subscribe fewer gateway replicas")
            snapshot = EventBatch(self._seq, time.time(), (AllBlocksCleared(), *self._held()), snapshot=True)
            self._subscribers.add(sub)
        sub.queue.put_nowait(snapshot)
        return sub

    def end_all(self) -> None:
        """From any thread: end every subscriber's stream (the engine drains; streams must not hold it open)."""
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            try:
                sub.loop.call_soon_threadsafe(sub.end)
            except RuntimeError:
                self.unsubscribe(sub)

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(sub)

    def _apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            size, parent = event.block_size, event.parent_block_hash
            for i, name in enumerate(event.block_hashes):
                self._blocks[name] = (parent, event.token_ids[i * size:(i + 1) * size], size,
                                      (event.lora_name, event.lora_id))
                parent = name
        elif isinstance(event, BlockRemoved):
            for name in event.block_hashes:
                self._blocks.pop(name, None)
        else:
            self._blocks.clear()

    def _held(self) -> list[BlockStored]:
        """Every block held, each after its parent (a chain in one event where it runs on)."""
        runs: list[tuple[list[int], int | None, list[int], int, tuple]] = []  # hashes, parent, tokens, size, adapter
        emitted: set[int] = set()
        for name in self._blocks:
            chain = []
            while name is not None and name in self._blocks and name not in emitted:
                emitted.add(name)
                chain.append(name)
                name = self._blocks[name][0]
            for block in reversed(chain):
                parent, tokens, size, lora = self._blocks[block]
                if runs and runs[-1][0][-1] == parent and runs[-1][3] == size and runs[-1][4] == lora:
                    runs[-1][0].append(block)
                    runs[-1][2].extend(tokens)
                else:
                    runs.append(([block], parent, list(tokens), size, lora))
        return [BlockStored(tuple(h), parent, tuple(t), size, *lora) for h, parent, t, size, lora in runs]
