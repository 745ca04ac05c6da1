"""The Batch API's state in Redis, shared by every gateway replica and kept across restarts (kvfleet/fleet/redis_keys.py
names the keys): file records, batch records, which replica runs each batch (a lease), and each request's answer,
written once per custom_id (HSETNX): a replica that dies mid-batch loses nothing, and the one that takes the batch
over skips what is answered, so no custom_id is answered twice.

A batch is a Redis hash: `record` (what never changes: endpoint, files, window, times, metadata, tenant), `status`
and each status's `<status>_at`, `total`, and the output and error file ids once written. Status changes are
compare-and-set (a Lua script), so a cancel and a runner's finish cannot both win.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio

from kvfleet.fleet import redis_keys

# HSET the status (and the given fields) only while it is one of ARGV[2..n+1]; ARGV[1] = n; the rest field/value pairs.
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
local n = tonumber(ARGV[1])
for i = 2, n + 1 do
  if status == ARGV[i] then
    for j = n + 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
    return 1
  end
end
return 0
"""
# Keeps an answer in KEYS[1] (the output's) or KEYS[2] (the errors') as ARGV[3] says, unless either holds one.
_ANSWER = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local into = KEYS[2]
if ARGV[3] == '1' then into = KEYS[1] end
redis.call('HSET', into, ARGV[1], ARGV[2])
return 1
"""
LEASE_MS = 5_000  # a runner renews every second; a dead one's batch is taken over after this long


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None  # Unix seconds; None: kept until deleted

    def public(self) -> dict:
        """The File object as OpenAI answers it."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class BatchState:
    def __init__(self, client: redis.asyncio.Redis, fleet: str) -> None:
        self.redis = client
        self.fleet = fleet
        self._transition = client.register_script(_TRANSITION)
        self._answer = client.register_script(_ANSWER)

    # Files

    async def add_file(self, record: FileRecord) -> None:
        k = redis_keys
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(k.batch_files_key(self.fleet), record.id, json.dumps(record.__dict__))
            p.zadd(k.batch_tenant_files_key(self.fleet, record.tenant), {record.id: record.created_at})
            if record.expires_at is not None:
                p.zadd(k.batch_file_expiry_key(self.fleet), {record.id: record.expires_at})
            await p.execute()

    async def file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The tenant's file; None for another tenant's (its existence is not told) or none."""
        raw = await self.redis.hget(redis_keys.batch_files_key(self.fleet), file_id)
        if raw is None:
            return None
        record = FileRecord(**json.loads(raw))
        return record if record.tenant == tenant else None

    async def files(self, tenant: str) -> list[FileRecord]:
        """The tenant's files, oldest first."""
        ids = await self.redis.zrange(redis_keys.batch_tenant_files_key(self.fleet, tenant), 0, -1)
        if not ids:
            return []
        raws = await self.redis.hmget(redis_keys.batch_files_key(self.fleet), ids)
        return [FileRecord(**json.loads(r)) for r in raws if r is not None]

    async def remove_file(self, record: FileRecord) -> None:
        k = redis_keys
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(k.batch_files_key(self.fleet), record.id)
            p.zrem(k.batch_tenant_files_key(self.fleet, record.tenant), record.id)
            p.zrem(k.batch_file_expiry_key(self.fleet), record.id)
            await p.execute()

    async def expired_files(self, now: float, limit: int) -> list[FileRecord]:
        """Files whose expiry has passed, the oldest expiry first (at most `limit`)."""
        ids = await self.redis.zrangebyscore(redis_keys.batch_file_expiry_key(self.fleet), "-inf", now, 0, limit)
        if not ids:
            return []
        raws = await self.redis.hmget(redis_keys.batch_files_key(self.fleet), ids)
        found = [FileRecord(**json.loads(r)) for r in raws if r is not None]
        gone = [i for i, r in zip(ids, raws, strict=True) if r is None]
        if gone:  # deleted by a client meanwhile
            await self.redis.zrem(redis_keys.batch_file_expiry_key(self.fleet), *gone)
        return found

    # Batches

    async def add_batch(self, batch_id: str, tenant: str, record: dict, status: str, now: int) -> None:
        k = redis_keys
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(k.batch_key(self.fleet, batch_id), mapping={
                "record": json.dumps(record), "tenant": tenant, "status": status, f"{status}_at": now})
            p.zadd(k.batch_tenant_batches_key(self.fleet, tenant), {batch_id: now})
            p.zadd(k.batch_active_key(self.fleet), {batch_id: now})
            await p.execute()

    async def batch(self, batch_id: str) -> dict | None:
        """A batch's hash as strings (no tenant check: runners read any), None when there is none."""
        found = await self.redis.hgetall(redis_keys.batch_key(self.fleet, batch_id))
        return {k.decode(): v.decode() for k, v in found.items()} if found else None

    async def tenant_batch_ids(self, tenant: str) -> list[str]:
        ids = await self.redis.zrange(redis_keys.batch_tenant_batches_key(self.fleet, tenant), 0, -1)
        return [i.decode() for i in ids]

    async def active_batch_ids(self) -> list[str]:
        """Batches not yet finished, oldest first."""
        return [i.decode() for i in await self.redis.zrange(redis_keys.batch_active_key(self.fleet), 0, -1)]

    async def finished(self, batch_id: str) -> None:
        await self.redis.zrem(redis_keys.batch_active_key(self.fleet), batch_id)

    async def transition(self, batch_id: str, from_statuses: tuple[str, ...], to: str, now: int,
                         **fields: str | int) -> bool:
        """Sets the status to `to` (and `<to>_at`, and fields) if it is one of from_statuses; whether it did."""
        pairs = [str(x) for kv in {"status": to, f"{to}_at": now, **fields}.items() for x in kv]
        done = await self._transition(keys=[redis_keys.batch_key(self.fleet, batch_id)],
                                      args=[len(from_statuses), *from_statuses, *pairs])
        return bool(done)

    async def set_fields(self, batch_id: str, **fields: str | int) -> None:
        await self.redis.hset(redis_keys.batch_key(self.fleet, batch_id), mapping=fields)

    # Running

    async def claim(self, batch_id: str, owner: str) -> bool:
        """Takes the batch to run unless another live runner holds it (or renews this one's hold)."""
        key = redis_keys.batch_lease_key(self.fleet, batch_id)
        if await self.redis.set(key, owner, nx=True, px=LEASE_MS):
            return True
        held = await self.redis.get(key)
        if held is not None and held.decode() == owner:
            await self.redis.pexpire(key, LEASE_MS)
            return True
        return False

    async def release(self, batch_id: str, owner: str) -> None:
        key = redis_keys.batch_lease_key(self.fleet, batch_id)
        held = await self.redis.get(key)
        if held is not None and held.decode() == owner:
            await self.redis.delete(key)

    async def answer(self, batch_id: str, key: str, line: dict, ok: bool) -> bool:
        """Keeps a request's answer (an output-file line when ok, else an error-file line) under its custom_id (or
        `line:N` for a line that never ran) unless one is kept already; whether this one was."""
        done = await self._answer(keys=[redis_keys.batch_results_key(self.fleet, batch_id),
                                        redis_keys.batch_errors_key(self.fleet, batch_id)],
                                  args=[key, json.dumps(line), "1" if ok else "0"])
        return bool(done)

    async def answered(self, batch_id: str) -> set[str]:
        """The custom_ids (and `line:N` keys of lines without one) answered either way."""
        keys = await self.redis.hkeys(redis_keys.batch_results_key(self.fleet, batch_id))
        keys += await self.redis.hkeys(redis_keys.batch_errors_key(self.fleet, batch_id))
        return {k.decode() for k in keys}

    async def counts(self, batch_id: str, fields: dict | None = None) -> tuple[int, int]:
        """(completed, failed): as kept when the batch ended (in its `fields`), else counted so far."""
        if fields is not None and "completed" in fields:
            return int(fields["completed"]), int(fields["failed"])
        async with self.redis.pipeline(transaction=False) as p:
            p.hlen(redis_keys.batch_results_key(self.fleet, batch_id))
            p.hlen(redis_keys.batch_errors_key(self.fleet, batch_id))
            completed, failed = await p.execute()
        return int(completed), int(failed)

    async def answers(self, batch_id: str, ok: bool) -> list[dict]:
        key = (redis_keys.batch_results_key if ok else redis_keys.batch_errors_key)(self.fleet, batch_id)
        return [json.loads(v) for v in (await self.redis.hgetall(key)).values()]

    async def report_backlog(self, fleet: str, batch_id: str, backlog: dict | None) -> None:
        """A batch's unfinished work on `fleet`'s engines (None: it has none left), for the operator's autoscaler."""
        key = redis_keys.batch_backlog_key(fleet)
        if backlog is None:
            await self.redis.hdel(key, batch_id)
        else:
            await self.redis.hset(key, batch_id, json.dumps(backlog))

    async def drop_answers(self, batch_id: str) -> None:
        """Once the output and error files are written, the answers leave Redis."""
        await self.redis.delete(redis_keys.batch_results_key(self.fleet, batch_id),
                                redis_keys.batch_errors_key(self.fleet, batch_id))
