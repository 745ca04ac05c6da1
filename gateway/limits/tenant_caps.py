"""Per-tenant in-flight caps: how many requests a tenant may have admitted and not yet finished (waiting in the fleet
queue or at an engine), fleet-wide, so that one tenant cannot hold every engine slot and queue place that others
share. (Its cap on queued requests alone is the fleet queue's, atomic with the enqueue: queue/redis_backend.py.)

In Redis each tenant's admitted requests are a sorted set (request id -> lease expiry ms); a slot is taken with one
Lua script (drop expired leases, count, add) and given back at the request's end. The replica holding a request renews
its lease every few seconds, so the slots of a replica that died free themselves within LEASE_MS. While Redis is
unreachable each replica counts its own requests only (a cap per replica, not per fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from redis.asyncio import Redis

from kvfleet.fleet import redis_keys
from kvfleet.fleet.redis_errors import REDIS_DOWN

log = logging.getLogger(__name__)

LEASE_MS = 15_000  # a dead replica's slots are free again after this
RENEW_EVERY_S = 5.0

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


@dataclass
class Slot:
    """One admitted request's place in its tenant's in-flight count; `release` at its end (idempotent)."""

    tenant: str
    id: str
    local: bool  # taken in this process's fallback count
    owner: TenantInFlight
    started: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.give_back(self)


class TenantInFlight:
    def __init__(self, client: Redis | None, fleet: str, gateway_id: str):
        self.client, self.fleet, self.gateway_id = client, fleet, gateway_id
        self._acquire = client.register_script(_ACQUIRE) if client is not None else None
        self._held: dict[str, Slot] = {}
        self._local: Counter[str] = Counter()
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self.mean_duration_s: float | None = None  # of this replica's admitted requests lately (an EWMA)

    async def acquire(self, tenant: str, cap: int) -> Slot | None:
        """A slot for one more of the tenant's requests, or None when it has `cap` admitted already."""
        slot = Slot(tenant, f"{self.gateway_id}-{next(self._ids)}", local=self.client is None, owner=self)
        if not slot.local:
            now = time.time() * 1000.0
            try:
                taken = await self._acquire(keys=[redis_keys.tenant_inflight_key(self.fleet, tenant)],
                                            args=[now, now + LEASE_MS, cap, slot.id, LEASE_MS])
            except REDIS_DOWN as err:
                log.warning("tenant in-flight count unreachable in Redis (%s); counting in this process",
                            type(err).__name__)
                slot.local = True
            else:
                if not taken:
                    return None
        if slot.local:
            if self._local[tenant] >= cap:
                return None
            self._local[tenant] += 1
        self._held[slot.id] = slot
        return slot

    def retry_after_s(self, cap: int) -> int:
        """When one of a tenant's `cap` unfinished requests will likely have ended: a request's usual time in the
        gateway, over the cap; whole seconds, at least 1."""
        if not self.mean_duration_s or cap <= 0:
            return 1
        return max(1, math.ceil(self.mean_duration_s / cap))

    def give_back(self, slot: Slot) -> None:
        self._held.pop(slot.id, None)
        took = time.monotonic() - slot.started
        self.mean_duration_s = took if self.mean_duration_s is None else 0.9 * self.mean_duration_s + 0.1 * took
        if slot.local:
            self._local[slot.tenant] -= 1
            if self._local[slot.tenant] <= 0:
                del self._local[slot.tenant]
            return
        task = asyncio.get_running_loop().create_task(self._remove(slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, slot: Slot) -> None:
        with contextlib.suppress(*REDIS_DOWN):  # its lease runs out instead
            await self.client.zrem(redis_keys.tenant_inflight_key(self.fleet, slot.tenant), slot.id)

    async def renew_forever(self) -> None:
        """Extends the leases of this replica's admitted requests, so only a dead replica's run out."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            held = [s for s in self._held.values() if not s.local]
            if not held or self.client is None:
                continue
            expiry = time.time() * 1000.0 + LEASE_MS
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    for slot in held:
                        key = redis_keys.tenant_inflight_key(self.fleet, slot.tenant)
                        pipe.zadd(key, {slot.id: expiry}, xx=True)
                        pipe.pexpire(key, LEASE_MS)
                    await pipe.execute()
            except REDIS_DOWN as err:
                log.warning("renewing tenant in-flight leases failed: %s", type(err).__name__)

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
