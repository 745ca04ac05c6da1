"""The fleet-wide priority queue in Redis, shared by every gateway replica; each change is one atomic Lua script.

Its keys (the queue, its entries and classes, heartbeats, grants channels) are built in kvfleet.fleet.redis_keys.
"""

from __future__ import annotations

from redis.asyncio import Redis

from kvfleet.fleet import redis_keys
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.queue_order import QueueEntry

_ENQUEUE = """
local in_class = tonumber(redis.call('HGET', KEYS[3], ARGV[4]) or '0')
if in_class >= tonumber(ARGV[5]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""

_REMOVE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local meta = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if meta then redis.call('HINCRBY', KEYS[3], string.match(meta, '^[^|]*|([^|]*)|'), -1) end
return 1
"""

# Pops up to ARGV[1] heads, less what any replica released within the last ARGV[6] ms (replicas that saw the same
# free room between two scrapes must not each fill it); an entry whose owner has no heartbeat, or whose deadline
# is long past, is dropped and the next one taken. Entries of other live replicas are handed to them on their
# grants channel. ARGV[2] and ARGV[7] are the heartbeat and grants prefixes (redis_keys), to which an owner's id
# is appended.
_RELEASE = """
local released, count = {}, 0
local want = tonumber(ARGV[1]) - tonumber(redis.call('GET', KEYS[4]) or '0')
local now, grace = tonumber(ARGV[3]), tonumber(ARGV[4])
while count < want do
  local head = redis.call('ZPOPMIN', KEYS[1], 1)
  if #head == 0 then break end
  local id = head[1]
  local meta = redis.call('HGET', KEYS[2], id)
  redis.call('HDEL', KEYS[2], id)
  if meta then
    local owner, prio, deadline = string.match(meta, '^([^|]*)|([^|]*)|(.*)$')
    redis.call('HINCRBY', KEYS[3], prio, -1)
    if redis.call('EXISTS', ARGV[2] .. owner) == 1 and tonumber(deadline) + grace > now then
      if owner ~= ARGV[5] then redis.call('PUBLISH', ARGV[7] .. owner, id) end
      table.insert(released, id)
      table.insert(released, owner)
      count = count + 1
    end
  end
end
if count > 0 then
  redis.call('INCRBY', KEYS[4], count)
  redis.call('PEXPIRE', KEYS[4], ARGV[6])
end
return released
"""

_SWEEP = """
local removed = 0
local all = redis.call('HGETALL', KEYS[2])
local now, grace = tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, #all, 2 do
  local id, meta = all[i], all[i + 1]
  local owner, prio, deadline = string.match(meta, '^([^|]*)|([^|]*)|(.*)$')
  local orphan = ARGV[4] ~= '' and owner == ARGV[4] and redis.call('SISMEMBER', KEYS[4], id) == 0
  if orphan or redis.call('EXISTS', ARGV[1] .. owner) == 0 or tonumber(deadline) + grace < now then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HINCRBY', KEYS[3], prio, -1)
    removed = removed + 1
  end
end
return removed
"""


class RedisQueue:
    """Queue operations on one fleet's keys; raises redis' ConnectionError/TimeoutError when Redis is away."""

    def __init__(self, client: Redis, fleet: str, gateway_id: str, grace_ms: float = 5000.0):
        self.client, self.fleet, self.gateway_id, self.grace_ms = client, fleet, gateway_id, grace_ms
        self.keys = [redis_keys.queue_key(fleet), redis_keys.queue_entries_key(fleet),
                     redis_keys.queue_classes_key(fleet)]
        self.heartbeat_key = redis_keys.heartbeat_key(fleet, gateway_id)
        self._enqueue = client.register_script(_ENQUEUE)
        self._remove = client.register_script(_REMOVE)
        self._release = client.register_script(_RELEASE)
        self._sweep = client.register_script(_SWEEP)

    @property
    def grants_channel(self) -> str:
        return redis_keys.grants_channel(self.fleet, self.gateway_id)

    async def heartbeat(self, ttl_ms: int) -> None:
        await self.client.set(self.heartbeat_key, "1", px=ttl_ms)

    async def enqueue(self, entry: QueueEntry, cap: int) -> bool:
        meta = f"{entry.owner}|{entry.priority.value}|{int(entry.deadline_ms)}"
        return bool(await self._enqueue(keys=self.keys,
                                        args=[entry.id, entry.score, meta, entry.priority.value, cap]))

    async def remove(self, entry_id: str) -> bool:
        return bool(await self._remove(keys=self.keys, args=[entry_id]))

    async def release(self, n: int, now_ms: float, window_ms: int = 100) -> list[tuple[str, str]]:
        """Pops up to n entries in order, less those any replica released in the last window_ms (n is the room
        this replica sees, which the others see too); returns (id, owner) pairs, others' entries already granted."""
        flat = await self._release(keys=[*self.keys, redis_keys.queue_released_key(self.fleet)],
                                   args=[n, redis_keys.heartbeat_prefix(self.fleet), now_ms, self.grace_ms,
                                         self.gateway_id, window_ms, redis_keys.grants_prefix(self.fleet)])
        flat = [x.decode() if isinstance(x, bytes) else x for x in flat]
        return list(zip(flat[0::2], flat[1::2], strict=True))

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
        args = [redis_keys.heartbeat_prefix(self.fleet), now_ms, self.grace_ms, own]
        removed = await self._sweep(keys=[*self.keys, live_key], args=args)
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
