"""The fleet-wide queue in Redis, shared by every gateway replica; each change is one atomic Lua script, so every
replica releases in one global order: queue/fair_order.py's policy (fair share among tenants inside a band, priority
with aging across bands), which the scripts mirror step for step.

Its keys (the queue, its entries and classes, the bands' tenants, heartbeats, grants channels) are built in
kvfleet.fleet.redis_keys.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from kvfleet.fleet import redis_keys
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue.fair_order import MAX_IDLE_TENANTS, TENANTS_VISITED
from kvfleet.gateway.queue.order import Placement, QueueEntry, Refusal
from kvfleet.gateway.queue.wait import DRAIN_SAMPLE, DRAIN_WINDOW_S

IDLE_COUNTERS_TTL_MS = 3_600_000  # a band's idle counters go after an hour without any charge or departure
NO_BOUND = 1 << 50  # max_ahead when there is none
PLACED = {1: None, 0: Refusal.CLASS_FULL, 2: Refusal.TENANT_FULL, 3: Refusal.TOO_LONG}  # _ENQUEUE's statuses

# Every script starts with this prelude: the queue's keys (KEYS[1..5]: the queue, its entries, its classes, the band
# floors, its busy period's start), the band keys (KEYS[6..5+2n]: each band's active and idle tenants), the
# band names and tenant-key prefixes (ARGV[2..1+2n]), and helpers that keep the tenants' structures with the queue.
# Counters travel as the strings Redis gives (never Lua numbers, which print with 14 digits), so the Redis queue
# adds and compares exactly the doubles that queue/fair_order.py does.
_PRELUDE = """
local nb = tonumber(ARGV[1])
local band, ORDER = {}, {}
for i = 1, nb do
  local b = {name = ARGV[1 + i], active = KEYS[4 + 2 * i], idle = KEYS[5 + 2 * i], prefix = ARGV[1 + nb + i]}
  band[b.name] = b
  ORDER[i] = b
end
local MAX_IDLE, IDLE_TTL = tonumber(ARGV[2 + 2 * nb]), ARGV[3 + 2 * nb]
local A, K = 3 + 2 * nb, 5 + 2 * nb

local function trim_idle(b)
  local n = redis.call('ZCARD', b.idle)
  if n > MAX_IDLE then redis.call('ZREMRANGEBYRANK', b.idle, 0, n - MAX_IDLE - 1) end
  if n > 0 then redis.call('PEXPIRE', b.idle, IDLE_TTL) end
end

local function activate(b, tenant)
  if redis.call('ZSCORE', b.active, tenant) then return end
  local own = redis.call('ZSCORE', b.idle, tenant)
  if own then redis.call('ZREM', b.idle, tenant) else own = '0' end
  local low = redis.call('ZRANGE', b.active, 0, 0, 'WITHSCORES')
  local lift = low[2] or redis.call('HGET', KEYS[4], b.name) or '0'
  if tonumber(lift) > tonumber(own) then own = lift end
  redis.call('ZADD', b.active, own, tenant)
end

local function charge(b, tenant, amount)
  if redis.call('ZSCORE', b.active, tenant) then
    redis.call('ZINCRBY', b.active, amount, tenant)
  else
    redis.call('ZINCRBY', b.idle, amount, tenant)
    trim_idle(b)
  end
end

local function parse(meta)  -- owner|priority|deadline ms|charge|queued ms|tenant (tenant names hold no '|')
  local owner, prio, deadline, amount, queued, tenant =
    string.match(meta, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if owner == nil then  -- queued by a gateway from before queued times were kept
    owner, prio, deadline, amount, tenant = string.match(meta, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
    queued = ''
  end
  if owner == nil then  -- queued by a gateway from before tenants
    owner, prio, deadline = string.match(meta, '^([^|]*)|([^|]*)|(.*)$')
    amount, tenant = '0', ''
  end
  return owner, prio, deadline, amount, tenant, queued
end

local function unlink(id)
  redis.call('ZREM', KEYS[1], id)
  local meta = redis.call('HGET', KEYS[2], id)
  if not meta then return false end
  redis.call('HDEL', KEYS[2], id)
  if redis.call('HLEN', KEYS[2]) == 0 then redis.call('DEL', KEYS[5]) end  -- the busy period ends
  local owner, prio, deadline, amount, tenant = parse(meta)
  redis.call('HINCRBY', KEYS[3], prio, -1)
  local b = band[prio]
  if b then
    local key = b.prefix .. tenant
    redis.call('ZREM', key, id)
    local counter = redis.call('ZSCORE', b.active, tenant)
    if counter and redis.call('EXISTS', key) == 0 then
      redis.call('ZREM', b.active, tenant)
      redis.call('ZADD', b.idle, counter, tenant)
      redis.call('HSET', KEYS[4], b.name, counter)
      trim_idle(b)
    end
  end
  return true
end
"""

# Queues an entry unless its class is at its cap (0), its tenant has `tenant_cap` entries queued (2), or more entries
# would go before it than `max_ahead` (3: it could not be served by its deadline); 1 when queued. Returns {status,
# ahead}: about how many entries go before it (fair_order.FairOrder.ahead, the same estimate step for step).
_ENQUEUE = _PRELUDE + """
local id, score, meta, prio, cap, tenant = ARGV[A + 1], ARGV[A + 2], ARGV[A + 3], ARGV[A + 4], ARGV[A + 5], ARGV[A + 6]
local deadline, tenant_cap, max_ahead, policy = ARGV[A + 7], tonumber(ARGV[A + 8]), tonumber(ARGV[A + 9]), ARGV[A + 10]
if redis.call('HEXISTS', KEYS[2], id) == 1 then return {1, 0} end
local in_class = tonumber(redis.call('HGET', KEYS[3], prio) or '0')
if in_class >= tonumber(cap) then return {0, 0} end
if tenant_cap >= 0 then
  local mine = 0
  for _, o in ipairs(ORDER) do mine = mine + redis.call('ZCARD', o.prefix .. tenant) end
  if mine >= tenant_cap then return {2, mine} end
end
local b = band[prio]
local ahead = 0
if policy == 'fcfs' or not b then
  ahead = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. score)
else
  for _, o in ipairs(ORDER) do
    if o == b then break end
    ahead = ahead + tonumber(redis.call('HGET', KEYS[3], o.name) or '0')
  end
  local k = redis.call('ZCOUNT', b.prefix .. tenant, '-inf', '(' .. deadline)
  ahead = ahead + k
  local others = redis.call('ZCARD', b.active) - (redis.call('ZSCORE', b.active, tenant) and 1 or 0)
  if k == 0 then
    ahead = ahead + others
  elseif others <= tonumber(ARGV[A + 11]) then
    for _, t in ipairs(redis.call('ZRANGE', b.active, 0, -1)) do
      if t ~= tenant then ahead = ahead + math.min(redis.call('ZCARD', b.prefix .. t), k + 1) end
    end
  else  -- too many tenants to visit on every enqueue: a bound instead
    local theirs = tonumber(redis.call('HGET', KEYS[3], prio) or '0') - redis.call('ZCARD', b.prefix .. tenant)
    ahead = ahead + math.min(theirs, (k + 1) * others)
  end
end
if ahead > max_ahead then return {3, ahead} end
redis.call('ZADD', KEYS[1], score, id)
redis.call('HSET', KEYS[2], id, meta)
if redis.call('HLEN', KEYS[2]) == 1 then redis.call('SET', KEYS[5], ARGV[A + 12]) end  -- a busy period begins
redis.call('HINCRBY', KEYS[3], prio, 1)
if b then
  activate(b, tenant)
  redis.call('ZADD', b.prefix .. tenant, deadline, id)
end
return {1, ahead}
"""

_REMOVE = _PRELUDE + """
if unlink(ARGV[A + 1]) then return 1 end
return 0
"""

_CHARGE = _PRELUDE + """
local b = band[ARGV[A + 1]]
if b then charge(b, ARGV[A + 2], ARGV[A + 3]) end
return 1
"""

# Pops up to ARGV[A+1] entries by the policy (queue/fair_order.py), less what any replica released within the last
# window (replicas that saw the same free room between two scrapes must not each fill it); an entry whose owner has
# no heartbeat, or whose deadline is long past, is dropped and the next one taken. Entries of other live replicas
# are handed to them on their grants channel and leased to them (KEYS[K+2]) until they acknowledge. Each release's
# time goes into KEYS[K+3] (the drain rate; its member is "queued ms|id"), trimmed to the last ARGV[A+9] ms.
# Heartbeat keys and grants channels are a prefix and an owner's id.
_RELEASE = _PRELUDE + """
local want = tonumber(ARGV[A + 1]) - tonumber(redis.call('GET', KEYS[K + 1]) or '0')
local heartbeat, now, grace, me = ARGV[A + 2], tonumber(ARGV[A + 3]), tonumber(ARGV[A + 4]), ARGV[A + 5]
local window, grants, policy = ARGV[A + 6], ARGV[A + 7], ARGV[A + 8]

local function next_head()
  if policy == 'fair' then
    local best, best_score, best_key
    for _, b in ipairs(ORDER) do
      local low = redis.call('ZRANGE', b.active, 0, 0)
      while #low > 0 do
        local key = b.prefix .. low[1]
        local head = redis.call('ZRANGE', key, 0, 0)  -- the tenant's earliest deadline
        if #head > 0 then
          local score = tonumber(redis.call('ZSCORE', KEYS[1], head[1]) or '0')
          if best == nil or score < best_score then best, best_score, best_key = head[1], score, key end
          break
        end
        redis.call('ZREM', b.active, low[1])  -- a tenant without entries (Redis lost them) is not active
        low = redis.call('ZRANGE', b.active, 0, 0)
      end
    end
    if best then return best, best_key end
  end
  return redis.call('ZRANGE', KEYS[1], 0, 0)[1], nil
end

local released, count = {}, 0
while count < want do
  local id, key = next_head()
  if not id then break end
  local meta = redis.call('HGET', KEYS[2], id)
  if meta then
    local owner, prio, deadline, amount, tenant, queued = parse(meta)
    if redis.call('EXISTS', heartbeat .. owner) == 1 and tonumber(deadline) + grace > now then
      if policy == 'fair' and band[prio] then charge(band[prio], tenant, amount) end
      if owner ~= me then  -- leased to its owner until it acknowledges: a grant it misses is not lost
        redis.call('HSET', KEYS[K + 2], id, owner .. '|' .. ARGV[A + 3])
        redis.call('PUBLISH', grants .. owner, id)
      end
      table.insert(released, id)
      table.insert(released, owner)
      redis.call('ZADD', KEYS[K + 3], ARGV[A + 3], queued .. '|' .. id)
      count = count + 1
    end
  end
  unlink(id)
  if key then redis.call('ZREM', key, id) end
end
if count > 0 then
  redis.call('INCRBY', KEYS[K + 1], count)
  redis.call('PEXPIRE', KEYS[K + 1], window)
  redis.call('ZREMRANGEBYSCORE', KEYS[K + 3], '-inf', string.format('(%.3f', now - tonumber(ARGV[A + 9])))
  redis.call('PEXPIRE', KEYS[K + 3], ARGV[A + 9])
end
return released
"""

_SWEEP = _PRELUDE + """
local heartbeat, now, grace, own = ARGV[A + 1], tonumber(ARGV[A + 2]), tonumber(ARGV[A + 3]), ARGV[A + 4]
local removed = 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local id = all[i]
  local owner, prio, deadline = parse(all[i + 1])
  local orphan = own ~= '' and owner == own and redis.call('SISMEMBER', KEYS[K + 1], id) == 0
  if orphan or redis.call('EXISTS', heartbeat .. owner) == 0 or tonumber(deadline) + grace < now then
    unlink(id)
    removed = removed + 1
  end
end
return removed
"""

# Drops leases (KEYS[1]) whose owner has no heartbeat (it died, and its clients' connections with it) or that are
# older than ARGV[3] ms (their owner no longer waits on them); returns how many went.
_SWEEP_LEASES = """
local heartbeat, now, max_age = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local removed = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local owner, released = string.match(all[i + 1], '^([^|]*)|(.*)$')
  if owner == nil or redis.call('EXISTS', heartbeat .. owner) == 0 or (tonumber(released) or 0) + max_age < now then
    redis.call('HDEL', KEYS[1], all[i])
    removed = removed + 1
  end
end
return removed
"""


class RedisQueue:
    """Queue operations on one fleet's keys; raises redis' ConnectionError/TimeoutError when Redis is away."""

    def __init__(self, client: Redis, fleet: str, gateway_id: str, grace_ms: float = 5000.0, policy: str = "fair",
                 max_idle: int = MAX_IDLE_TENANTS):
        self.client, self.fleet, self.gateway_id, self.grace_ms = client, fleet, gateway_id, grace_ms
        self.policy = policy
        bands = sorted(Priority, key=lambda p: p.rank)
        self.keys = [redis_keys.queue_key(fleet), redis_keys.queue_entries_key(fleet),
                     redis_keys.queue_classes_key(fleet), redis_keys.queue_floors_key(fleet),
                     redis_keys.queue_busy_since_key(fleet)]
        for p in bands:
            self.keys += [redis_keys.queue_band_tenants_key(fleet, p), redis_keys.queue_band_idle_key(fleet, p)]
        self._band_args = [len(bands), *(p.value for p in bands),
                           *(redis_keys.queue_band_tenant_prefix(fleet, p) for p in bands),
                           max_idle, IDLE_COUNTERS_TTL_MS]
        self.heartbeat_key = redis_keys.heartbeat_key(fleet, gateway_id)
        self._scripts = {name: client.register_script(lua) for name, lua in
                         (("enqueue", _ENQUEUE), ("remove", _REMOVE), ("charge", _CHARGE), ("release", _RELEASE),
                          ("sweep", _SWEEP), ("sweep_leases", _SWEEP_LEASES))}

    async def _run(self, script: str, args: list, keys: tuple[str, ...] = ()):
        return await self._scripts[script](keys=[*self.keys, *keys], args=[*self._band_args, *args])

    @property
    def grants_channel(self) -> str:
        return redis_keys.grants_channel(self.fleet, self.gateway_id)

    async def heartbeat(self, ttl_ms: int) -> None:
        await self.client.set(self.heartbeat_key, "1", px=ttl_ms)

    async def enqueue(self, entry: QueueEntry, cap: int) -> bool:
        """Queues the entry unless its class holds `cap` entries."""
        return (await self.place(entry, cap)).queued

    async def place(self, entry: QueueEntry, cap: int, tenant_cap: int | None = None,
                    max_ahead: int | None = None) -> Placement:
        """Queues the entry unless its class holds `cap` entries, its tenant `tenant_cap`, or more than `max_ahead`
        would go before it (None: no such bound); how many go before it either way."""
        queued = "" if entry.arrival_ms is None else repr(float(entry.arrival_ms))
        meta = (f"{entry.owner}|{entry.priority.value}|{int(entry.deadline_ms)}|{float(entry.charge)!r}|{queued}|"
                f"{entry.tenant}")
        status, ahead = await self._run("enqueue", [
            entry.id, entry.score, meta, entry.priority.value, cap, entry.tenant, repr(float(entry.deadline_ms)),
            -1 if tenant_cap is None else tenant_cap, NO_BOUND if max_ahead is None else max_ahead, self.policy,
            TENANTS_VISITED, queued or repr(time.time() * 1000.0)])
        return Placement(PLACED[int(status)], int(ahead))

    async def remove(self, entry_id: str) -> bool:
        return bool(await self._run("remove", [entry_id]))

    async def charge(self, priority: Priority, tenant: str, amount: float) -> None:
        """Adds service (tokens / weight; negative to correct an estimate) to a tenant's counter in a band."""
        await self._run("charge", [priority.value, tenant, repr(float(amount))])

    async def release(self, n: int, now_ms: float, window_ms: int = 100) -> list[tuple[str, str]]:
        """Pops up to n entries in order, less those any replica released in the last window_ms (n is the room
        this replica sees, which the others see too); returns (id, owner) pairs, others' entries already granted."""
        flat = await self._run("release", [n, redis_keys.heartbeat_prefix(self.fleet), now_ms, self.grace_ms,
                                           self.gateway_id, window_ms, redis_keys.grants_prefix(self.fleet),
                                           self.policy, DRAIN_WINDOW_S * 1000],
                                  keys=(redis_keys.queue_released_key(self.fleet), self.leases_key,
                                        redis_keys.queue_drained_key(self.fleet)))
        flat = [x.decode() if isinstance(x, bytes) else x for x in flat]
        return list(zip(flat[0::2], flat[1::2], strict=True))

    async def drained(self, now_ms: float) -> tuple[list[tuple[float, float]], float | None]:
        """The last DRAIN_SAMPLE entries released fleet-wide within the last DRAIN_WINDOW_S seconds, newest first,
        each as (queued, released) in seconds since the epoch (one queued by a gateway from before queued times
        were kept: waited no time), and when the queue's busy period began (None while it is empty)."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zrevrangebyscore(redis_keys.queue_drained_key(self.fleet), "+inf",
                                  f"({now_ms - DRAIN_WINDOW_S * 1000}", start=0, num=DRAIN_SAMPLE, withscores=True)
            pipe.get(redis_keys.queue_busy_since_key(self.fleet))
            newest, busy_since = await pipe.execute()
        releases = []
        for member, released_ms in newest:
            queued, sep, _ = (member.decode() if isinstance(member, bytes) else member).partition("|")
            releases.append((float(queued) / 1000.0 if sep and queued else released_ms / 1000.0, released_ms / 1000.0))
        return releases, None if busy_since is None else float(busy_since) / 1000.0

    async def sweep(self, now_ms: float, own_live_ids: set[str] | None = None) -> int:
        """Drops entries of dead replicas and long-expired ones; with own_live_ids, this replica's orphans too."""
        live_key = redis_keys.live_entries_key(self.fleet, self.gateway_id)
        own = ""
        if own_live_ids is not None:
            own = self.gateway_id
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(live_key)
                if own_live_ids:
                    pipe.sadd(live_key, *own_live_ids)
                    pipe.pexpire(live_key, 10_000)
                await pipe.execute()
        removed = await self._run("sweep", [redis_keys.heartbeat_prefix(self.fleet), now_ms, self.grace_ms, own],
                                  keys=(live_key,))
        if own_live_ids is not None:
            await self.client.delete(live_key)
        return int(removed)

    async def counts(self) -> dict[Priority, int]:
        raw = await self.client.hgetall(self.keys[2])
        counts = {p: 0 for p in Priority}
        for k, v in raw.items():
            name = k.decode() if isinstance(k, bytes) else k
            if name in Priority._value2member_map_:
                counts[Priority(name)] = max(0, int(v))
        return counts

    # ---- leases: an entry released to another replica is leased to it until it says it has the grant ----------
    @property
    def leases_key(self) -> str:
        return redis_keys.queue_leases_key(self.fleet)

    async def leased(self, entry_ids: list[str]) -> set[str]:
        """Those of this replica's entries that another replica released to it and it has not acknowledged."""
        if not entry_ids:
            return set()
        values = await self.client.hmget(self.leases_key, entry_ids)
        return {i for i, v in zip(entry_ids, values, strict=True) if v is not None}

    async def acknowledge(self, entry_ids: list[str]) -> None:
        """This replica has the grants of these entries: their leases go."""
        if entry_ids:
            await self.client.hdel(self.leases_key, *entry_ids)

    async def sweep_leases(self, now_ms: float, lease_ms: float) -> int:
        """Drops the leases of dead replicas, and those unacknowledged for lease_ms plus the grace (long expired)."""
        removed = await self._scripts["sweep_leases"](
            keys=[self.leases_key], args=[redis_keys.heartbeat_prefix(self.fleet), now_ms, lease_ms + self.grace_ms])
        return int(removed)
