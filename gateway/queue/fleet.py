"""Where saturated requests wait: the fleet-wide Redis queue, or an in-process one while Redis is unreachable.

Each replica keeps a future per request it holds. Any replica that sees free capacity releases the next entries
by the queue policy (queue/fair_order.py); a released entry of another replica reaches it on its grants channel. A
replica's heartbeat keeps its entries alive, so the entries of one that died are dropped, and a periodic reconcile
puts back entries Redis lost (a restart) and removes this replica's orphans. An entry released for another replica
holds a lease until its owner takes the grant: a grant lost on the channel is found by the owner's reconcile, and a
dead owner's leases are swept. Entries carry deadlines: one whose queue ahead cannot drain in time at the fleet's
measured drain rate is refused when it would be queued (queue/wait.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from redis.asyncio import Redis

from kvfleet.fleet.priority import Priority
from kvfleet.fleet.redis_errors import CLIENT_OPTIONS, REDIS_DOWN
from kvfleet.gateway.queue.local import LocalQueue
from kvfleet.gateway.queue.order import DEFAULT_TENANT, Placement, QueueEntry, queue_score
from kvfleet.gateway.queue.redis_backend import RedisQueue
from kvfleet.gateway.queue.wait import DRAIN_SAMPLE, drain_rate, max_ahead

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    GRANTED = "granted"
    EXPIRED = "expired"


def now_ms() -> float:
    return time.time() * 1000.0


class FleetQueue:
    def __init__(self, redis_url: str | None, fleet: str, gateway_id: str, aging_ms: float,
                 caps: dict[Priority, int], heartbeat_ms: int = 3000,
                 on_backend_change: Callable[[bool], None] = lambda using_redis: None, policy: str = "fair"):
        self.fleet, self.gateway_id, self.aging_ms, self.caps = fleet, gateway_id, aging_ms, caps
        self.policy = policy
        self.heartbeat_ms = heartbeat_ms
        self.release_window_ms = 100  # about one scrape interval; the gateway sets it from its config
        self.on_backend_change = on_backend_change
        # health_check_interval: a pooled connection idle for a second is pinged before use, so connections left
        # from before a Redis restart are found dead before a real command meets them
        self.client = Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                     health_check_interval=1, **CLIENT_OPTIONS) if redis_url else None
        self.redis = RedisQueue(self.client, fleet, gateway_id, policy=policy) if self.client else None
        self.using_redis = False
        self.redis_error: str | None = None if redis_url else "no Redis configured"
        self.local = LocalQueue(policy)
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._entries: dict[str, QueueEntry] = {}
        self._counts = {p: 0 for p in Priority}
        self._missing_once: set[str] = set()
        self._stopping = False
        self._drained: list[tuple[float, float]] = []  # the fleet's latest releases (queued, released), as of then
        self._busy_since: float | None = None  # when the fleet queue last began to hold entries, as of then
        self._local_drained: deque[tuple[float, float]] = deque(maxlen=DRAIN_SAMPLE)  # its own while Redis is down
        self._tasks: list[asyncio.Task] = []
        self._seq = 0
        self._restore_failures = 0

    # ---- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.redis is not None:
            await self._try_restore()
        self._tasks = [asyncio.create_task(self._maintain(), name="queue maintenance"),
                       asyncio.create_task(self._listen(), name="queue grants")]

    async def stop(self) -> None:
        self._stopping = True  # redis-py can swallow a cancel inside a read (as a timeout): the loops also see this
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=5.0)
        for entry_id in list(self._waiters):
            await self._remove(entry_id)
        if self.client is not None:
            try:
                await self.redis.acknowledge(list(self._waiters))  # nobody here takes their grants any more
                await self.client.delete(self.redis.heartbeat_key)
            except REDIS_DOWN:
                pass
            await self.client.aclose()

    @property
    def backend(self) -> str:
        return "redis" if self.using_redis else "local"

    # ---- what the gateway asks ----------------------------------------------------------------------------
    def counts(self) -> dict[Priority, int]:
        """Queued entries by class, fleet-wide as of the last refresh (this replica's alone while degraded)."""
        return dict(self._counts) if self.using_redis else self.local.counts()

    def total(self) -> int:
        return sum(self.counts().values())

    async def refresh_counts(self) -> int:
        if self.using_redis:
            try:
                self._counts = await self.redis.counts()
                self._drained, self._busy_since = await self.redis.drained(now_ms())
            except REDIS_DOWN as err:
                await self._degrade(err)
        return self.total()

    def drain_rate_per_s(self) -> float | None:
        """Entries the queue released per second lately, fleet-wide (this replica's while degraded); None while too
        few were released to tell (queue/wait.py)."""
        if self.using_redis:
            return drain_rate(self._drained, time.time(), self._busy_since)
        return drain_rate(self._local_drained, time.time(), self.local.busy_since)

    async def enqueue(self, priority: Priority, max_wait_ms: float, tenant: str = DEFAULT_TENANT,
                      charge: float = 0.0) -> QueueEntry | None:
        """Queues a tenant's request, to be charged `charge` (tokens / weight) on release; None when its class is at
        its cap."""
        entry, placement = await self.place(priority, max_wait_ms, tenant, charge, deadline_aware=False)
        return entry if placement.queued else None

    async def place(self, priority: Priority, max_wait_ms: float, tenant: str = DEFAULT_TENANT,
                    charge: float = 0.0, tenant_cap: int | None = None,
                    deadline_aware: bool = True) -> tuple[QueueEntry, Placement]:
        """Queues a tenant's request, to be charged `charge` (tokens / weight) on release, unless its class is at its
        cap, its tenant has `tenant_cap` entries queued, or (deadline_aware) the queue ahead of it cannot drain within
        max_wait_ms at the fleet's drain rate. The entry, and what became of it."""
        self._seq += 1
        arrival = now_ms()
        entry = QueueEntry(id=f"{self.gateway_id}-{self._seq}", priority=priority,
                           score=queue_score(arrival, priority, self.aging_ms),
                           deadline_ms=arrival + max_wait_ms, owner=self.gateway_id, tenant=tenant, charge=charge,
                           arrival_ms=arrival)
        bound = max_ahead(self.drain_rate_per_s(), max_wait_ms) if deadline_aware else None
        # registered first, so a reconcile running meanwhile does not take it for an orphan
        self._entries[entry.id] = entry
        self._waiters[entry.id] = asyncio.get_running_loop().create_future()
        placement = await self._place(entry, self.caps[priority], tenant_cap, bound)
        if not placement.queued:
            self._entries.pop(entry.id)
            self._waiters.pop(entry.id)
        return entry, placement

    async def _place(self, entry: QueueEntry, cap: int, tenant_cap: int | None, bound: int | None) -> Placement:
        if self.using_redis:
            try:
                placement = await self.redis.place(entry, cap, tenant_cap, bound)
                if placement.queued:
                    self._counts[entry.priority] += 1
                return placement
            except REDIS_DOWN as err:
                await self._degrade(err)
        return self.local.place(entry, cap, tenant_cap, bound)

    async def charge(self, priority: Priority, tenant: str, amount: float) -> None:
        """Adds service to a tenant's counter (a request sent without queueing, or a correction at its end); a no-op
        under the fcfs policy. Never raises: a lost charge only blurs the shares."""
        if self.policy != "fair" or not amount:
            return
        if self.using_redis:
            try:
                await self.redis.charge(priority, tenant, amount)
                return
            except REDIS_DOWN as err:
                await self._degrade(err)
            except Exception as err:
                log.warning("charging tenant %s failed: %s: %s", tenant, type(err).__name__, err)
                return
        self.local.charge(priority, tenant, amount)

    async def wait(self, entry: QueueEntry) -> Outcome:
        """Until the entry is released (GRANTED) or its deadline passes (EXPIRED); it leaves the queue then. A wait
        that is cancelled (its client left: the Python front saw the connection close, or gRPC cancelled the
        picker's stream when Envoy's client left) takes its entry out of the queue at once, so that it holds no
        place, and later no release, for nobody."""
        granted = self._waiters[entry.id]
        try:
            timeout = max(0.0, (entry.deadline_ms - now_ms()) / 1000.0)
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(granted)
                return Outcome.GRANTED
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._remove(entry.id))
                raise
            if not await self._remove(entry.id):  # already popped by a release: its grant is on the way
                try:
                    async with asyncio.timeout(1.0):
                        await asyncio.shield(granted)
                    return Outcome.GRANTED
                except TimeoutError:
                    pass
            return Outcome.EXPIRED
        finally:
            self._waiters.pop(entry.id, None)
            self._entries.pop(entry.id, None)
            self._missing_once.discard(entry.id)

    async def release(self, n: int) -> list[tuple[str, str]]:
        """Pops up to n heads fleet-wide; this replica's are granted here, others' on their channel."""
        if n <= 0:
            return []
        if self.using_redis:
            try:
                released = await self.redis.release(n, now_ms(), self.release_window_ms)
            except REDIS_DOWN as err:
                await self._degrade(err)
                return []
            for entry_id, owner in released:
                if owner == self.gateway_id:
                    self._grant(entry_id)
            if released:  # what is left queued, and the drain rate with these releases in it, as of now
                await self.refresh_counts()
            return released
        out = []
        for entry in self.local.release(n):
            released = time.time()
            self._local_drained.append((released if entry.arrival_ms is None else entry.arrival_ms / 1000.0, released))
            self._grant(entry.id)
            out.append((entry.id, self.gateway_id))
        return out

    # ---- internals --------------------------------------------------------------------------------------
    def _grant(self, entry_id: str) -> None:
        waiter = self._waiters.get(entry_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _remove(self, entry_id: str) -> bool:
        if self.local.remove(entry_id):
            return True
        if not self.using_redis:
            return False
        try:
            removed = await self.redis.remove(entry_id)
        except REDIS_DOWN as err:
            await self._degrade(err)
            return self.local.remove(entry_id)
        entry = self._entries.get(entry_id)
        if removed and entry is not None:  # counted out at once, as a release is: has_room reads the count
            self._counts[entry.priority] = max(0, self._counts[entry.priority] - 1)
        return removed

    async def _degrade(self, err: BaseException) -> None:
        """Redis went away: this replica's waiting entries move to the in-process queue, in their order."""
        if not self.using_redis:
            return
        self.using_redis = False
        self.redis_error = f"Redis unreachable ({type(err).__name__}: {err}); queueing in this process"
        log.warning("%s", self.redis_error)
        for entry_id, entry in self._entries.items():
            if not self._waiters[entry_id].done():
                self.local.enqueue(entry, cap=None)
        self.on_backend_change(False)

    async def _try_restore(self) -> None:
        try:
            await self._restore()
        except REDIS_DOWN as err:
            self.redis_error = f"Redis unreachable ({type(err).__name__}: {err}); queueing in this process"
            self._restore_failures += 1
            if self._restore_failures % 10 == 1:  # the first failure of an outage, then every ten seconds
                log.warning("%s (attempt %d to move back)", self.redis_error, self._restore_failures)
        except Exception as err:
            log.warning("Redis answered but the queue could not move back yet: %s: %s", type(err).__name__, err)

    async def _restore(self) -> None:
        # Pooled connections from before the outage are dead; a restore that met them one by one would take as
        # many attempts as the pool had connections, and go back to degraded on the next stale one.
        await self.client.connection_pool.disconnect()
        await self.client.ping()
        await self.redis.heartbeat(self.heartbeat_ms)
        # entries another replica released to this one during the outage (their leases say so) had their turn:
        # granted now, not queued a second time
        for entry_id in await self._take_missed_grants(set(self.local.order.entries)):
            self.local.remove(entry_id)
        while len(self.local):
            pending = self.local.drain()
            try:
                while pending:
                    await self.redis.enqueue(pending[0], cap=1 << 30)
                    pending.pop(0)
            except BaseException:
                for entry in pending:  # not handed back yet: keep them here, in order
                    self.local.enqueue(entry, cap=None)
                raise
        self._counts = await self.redis.counts()
        self._restore_failures = 0
        was_degraded = self.redis_error is not None
        self.using_redis, self.redis_error = True, None
        if was_degraded:
            log.warning("Redis is reachable again; the fleet queue is back in Redis")
        self.on_backend_change(True)

    async def _maintain(self) -> None:
        """Heartbeat every second; every other second, drop dead replicas' entries and leases, take grants whose
        message was lost (by their leases) and put back entries Redis lost."""
        tick = 0
        while not self._stopping:
            await asyncio.sleep(1.0)
            tick += 1
            if self.redis is None:
                continue
            if not self.using_redis:
                await self._try_restore()
                continue
            try:
                await self.redis.heartbeat(self.heartbeat_ms)
                if tick % 2 == 0:
                    await self._reconcile()
            except REDIS_DOWN as err:
                await self._degrade(err)
            except Exception as err:  # a Redis that answers oddly (loading, errors) must not stop maintenance
                log.warning("fleet queue maintenance failed: %s: %s", type(err).__name__, err)

    async def _reconcile(self) -> None:
        live = {i for i, w in self._waiters.items() if not w.done()}
        await self.redis.sweep(now_ms(), own_live_ids=live)
        await self.redis.sweep_leases(now_ms(), self.heartbeat_ms)
        if not live:
            self._missing_once.clear()
            return
        ids = sorted(live)
        scores = await self.client.zmscore(self.redis.keys[0], ids)
        missing = {i for i, s in zip(ids, scores, strict=True) if s is None}
        missing -= await self._take_missed_grants(missing)  # released, not lost: never queued again
        for entry_id in missing & self._missing_once:  # gone twice in a row: Redis lost it, not a grant in flight
            if entry_id in self._entries and not self._waiters[entry_id].done():
                await self.redis.enqueue(self._entries[entry_id], cap=1 << 30)
        self._missing_once = missing - self._missing_once
        self._counts = await self.redis.counts()

    async def _listen(self) -> None:
        """Grants from other replicas; resubscribes after Redis comes back."""
        while not self._stopping:
            if not self.using_redis:
                await asyncio.sleep(0.2)
                continue
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.redis.grants_channel)
                while self.using_redis and not self._stopping:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message and message.get("type") == "message":
                        data = message["data"]
                        entry_id = data.decode() if isinstance(data, bytes) else data
                        self._grant(entry_id)
                        await self.redis.acknowledge([entry_id])
            except REDIS_DOWN as err:
                await self._degrade(err)
            except Exception as err:
                log.warning("listening for grants failed: %s: %s", type(err).__name__, err)
                await asyncio.sleep(0.2)
            finally:
                try:
                    await pubsub.aclose()
                except REDIS_DOWN:
                    pass

    async def _take_missed_grants(self, missing: set[str]) -> set[str]:
        """Of this replica's entries gone from the queue, those another replica released to it (a lease says so)
        while its message on the grants channel was lost: granted now, their leases acknowledged."""
        leased = sorted(await self.redis.leased(sorted(missing)))
        for entry_id in leased:
            log.info("entry %s was released to this replica but its grant never came; granting it now", entry_id)
            self._grant(entry_id)
        await self.redis.acknowledge(leased)
        return set(leased)
