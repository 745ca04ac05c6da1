"""The same queue in one process: what a gateway uses while Redis is unreachable (same order, same caps)."""

from __future__ import annotations

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.fair_order import FairOrder
from kvfleet.gateway.queue_order import QueueEntry


class LocalQueue:
    def __init__(self, policy: str = "fair") -> None:
        self.order = FairOrder(policy)
        self._counts = {p: 0 for p in Priority}

    def enqueue(self, entry: QueueEntry, cap: int | None) -> bool:
        if entry.id in self.order.entries:
            return True
        if cap is not None and self._counts[entry.priority] >= cap:
            return False
        self.order.add(entry)
        self._counts[entry.priority] += 1
        return True

    def remove(self, entry_id: str) -> bool:
        entry = self.order.remove(entry_id)
        if entry is None:
            return False
        self._counts[entry.priority] -= 1
        return True

    def release(self, n: int, charge: bool = True) -> list[QueueEntry]:
        """Up to n entries in the policy's order; each one's tenant is charged its cost (fair policy)."""
        out = []
        while len(out) < n:
            entry = self.order.pop(charge)
            if entry is None:
                break
            self._counts[entry.priority] -= 1
            out.append(entry)
        return out

    def charge(self, priority: Priority, tenant: str, amount: float) -> None:
        self.order.charge(priority, tenant, amount)

    def drain(self) -> list[QueueEntry]:
        """Everything, in order, uncharged (used when handing the entries back to Redis)."""
        return self.release(len(self.order), charge=False)

    def counts(self) -> dict[Priority, int]:
        return dict(self._counts)

    def __len__(self) -> int:
        return len(self.order)
