"""A test's subscriber to an engine's GET /kv_events: reads the Server-Sent Events in a thread, decoded."""

from __future__ import annotations

import threading
import time

import httpx

from kvfleet.fleet.kv_events import KV_EVENTS_PATH, BlockRemoved, BlockStored, EventBatch, decode_batch


class EventStream:
    def __init__(self, engine_url: str, headers: dict[str, str] | None = None) -> None:
        self.batches: list[EventBatch] = []
        self.status: int | None = None
        self.ended = threading.Event()
        self._client = httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0))
        self._thread = threading.Thread(target=self._read, args=(engine_url + KV_EVENTS_PATH, headers or {}),
                                        daemon=True)
        self._thread.start()

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            with self._client.stream("GET", url, headers=headers) as response:
                self.status = response.status_code
                data: list[str] = []
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif not line and data:
                        self.batches.append(decode_batch("\n".join(data)))
                        data = []
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()

    def close(self) -> None:
        self._client.close()

    def stored(self) -> list[BlockStored]:
        return [e for b in list(self.batches) for e in b.events if isinstance(e, BlockStored)]

    def removed(self) -> set[int]:
        return {h for b in list(self.batches) for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes}

    def wait_for(self, what, timeout: float = 20.0):  # noqa: ANN001 - a predicate over this stream
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = what(self)
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"the KV-event stream never showed it; batches: {self.batches[-5:]}")
