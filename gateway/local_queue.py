"""The same queue in one process: what a gateway uses while Redis is unreachable (same order, same caps)."""

from __future__ import annotations

import heapq

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue_order import QueueEntry


class LocalQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._entries: dict[str, QueueEntry] = {}
        self._seq = 0
        self._counts = {p: 0 for p in Priority}

    def enqueue(self, entry: QueueEntry, cap: int | None) -> bool:
        if cap is not None and self._counts[entry.priority] >= cap:
            return False
        if entry.id not in self._entries:
            self._counts[entry.priority] += 1
        self._entries[entry.id] = entry
        self._seq += 1
        heapq.heappush(self._heap, (entry.score, self._seq, entry.id))
        return True

    def remove(self, entry_id: str) -> bool:
        entry = self._entries.pop(entry_id, None)  # its heap slot is skipped when it surfaces
        if entry is None:
            return False
        self._counts[entry.priority] -= 1
        return True

    def release(self, n: int) -> list[QueueEntry]:
        out = []
        while self._heap and len(out) < n:
            _, _, entry_id = heapq.heappop(self._heap)
            entry = self._entries.pop(entry_id, None)
            if entry is not None:
                self._counts[entry.priority] -= 1
                out.append(entry)
        return out

    def drain(self) -> list[QueueEntry]:
        """Everything, in order (used when handing the entries back to Redis)."""
        return self.release(len(self._entries))

    def counts(self) -> dict[Priority, int]:
        return dict(self._counts)

    def __len__(self) -> int:
        return len(self._entries)
