"""The same queue in one process: what a gateway uses while Redis is unreachable (same order, same caps)."""

from __future__ import annotations

import time

from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.fair_order import FairOrder
from kvfleet.gateway.queue.order import Placement, QueueEntry, Refusal


class LocalQueue:
    def __init__(self, policy: str = "fair") -> None:
        self.order = FairOrder(policy)
        self._counts = {p: 0 for p in Priority}
        self._busy_since = 0.0

    def enqueue(self, entry: QueueEntry, cap: int | None) -> bool:
        return self.place(entry, cap).queued

    def place(self, entry: QueueEntry, cap: int | None, tenant_cap: int | None = None,
              max_ahead: int | None = None) -> Placement:
        """The Redis queue's `place`, step for step: refused when the class holds `cap` entries, the tenant
        `tenant_cap`, or more than `max_ahead` would go before it."""
        if entry.id in self.order.entries:
            return Placement(None, 0)
        if cap is not None and self._counts[entry.priority] >= cap:
            return Placement(Refusal.CLASS_FULL, 0)
        if tenant_cap is not None and (mine := self.order.queued_by(entry.tenant)) >= tenant_cap:
            return Placement(Refusal.TENANT_FULL, mine)
        ahead = self.order.ahead(entry)
        if max_ahead is not None and ahead > max_ahead:
            return Placement(Refusal.TOO_LONG, ahead)
        if not self.order:
            self._busy_since = time.time()
        self.order.add(entry)
        self._counts[entry.priority] += 1
        return Placement(None, ahead)

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

    @property
    def busy_since(self) -> float | None:
        """When (seconds since the epoch) the queue last began to hold entries; None while it is empty."""
        return self._busy_since if self.order else None

    def __len__(self) -> int:
        return len(self.order)
