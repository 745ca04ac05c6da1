"""Runs batches in the capacity interactive traffic leaves (capacity.py), on every gateway replica.

Each replica takes unfinished batches it can hold (a lease in Redis, renewed while it runs them; a dead replica's
batches are taken over when its lease lapses) and sends their requests to the engines of the model each names, one
request per free batch slot, tenants in turn (fair share among tenants' batches: a tenant's ten batches do not run
ten times as fast as another's one). An answer is kept once per custom_id (state.py): a batch taken over skips what
is answered. A request an engine could not take (it went away, it was draining, it was full) is sent again, up to
MAX_ATTEMPTS times; an answer with an error status is the error file's line for it.

A batch moves validating -> in_progress (its lines checked; bad lines become error lines at once) -> finalizing ->
completed, with its output and error files written; cancelling -> cancelled and the window's end -> expired keep
the answers already given (lines never sent get a `batch_cancelled` / `batch_expired` error line).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from kvfleet.fleet import headers
from kvfleet.fleet.priority import BATCH_ENGINE_PRIORITY
from kvfleet.gateway.batch.capacity import BatchRoom, batch_targets
from kvfleet.gateway.batch.files import FileStore, new_file_id
from kvfleet.gateway.batch.lines import Line, LineError, read_lines, token_estimate
from kvfleet.gateway.batch.objects import RUNNING
from kvfleet.gateway.batch.state import BatchState, FileRecord

log = logging.getLogger("kvfleet.gateway.batch")
MAX_ATTEMPTS = 5
RETRY_STATUSES = (429, 502, 503, 504)  # the engine could not take it now: another try, perhaps elsewhere
SCAN_S = 1.0  # how often the unfinished batches are looked at (claims, cancels, windows)
SWEEP_S = 60.0  # how often expired files are deleted
SWEEP_FILES = 100  # the most files one sweep deletes
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Running:
    """A batch this replica holds."""

    id: str
    tenant: str
    endpoint: str
    expires_at: int
    cores: dict[str, tuple[Any, str]] = field(default_factory=dict)  # model -> (the core serving it, its name there)
    pending: collections.deque[tuple[Line, int]] = field(default_factory=collections.deque)  # (line, attempts)
    in_flight: int = 0
    unwritten: list[tuple[str, dict, bool]] = field(default_factory=list)  # answers Redis did not take yet
    # per gateway core (its fleet): (share of the batch's requests, mean prompt tokens, mean output tokens)
    shape: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    stopping: str | None = None  # "cancelled" or "expired": send nothing more, finish when in flight is done
    output_ttl_s: int | None = None  # its output and error files' expiry (the batch's output_expires_after)


class BatchRunner:
    def __init__(self, state: BatchState, files: FileStore,
                 models: Callable[[], Awaitable[dict[str, tuple[Any, str]]]],
                 room: BatchRoom | None = None, clock: Callable[[], float] = time.time, metrics: Any = None,
                 file_ttl_s: int = 0) -> None:
        """models(): the model names served now, each with the gateway core (gateway/core.py) that serves it and
        the name its engines know it by. file_ttl_s: output files without the batch's output_expires_after expire
        this long after they are written (0: never)."""
        self.state, self.files, self.models = state, files, models
        self.file_ttl_s = file_ttl_s
        self._last_sweep = -math.inf
        self.room, self.clock, self.metrics = room or BatchRoom(), clock, metrics
        self.owner = secrets.token_hex(8)
        self.batches: dict[str, Running] = {}
        self.in_flight: collections.Counter[str] = collections.Counter()  # engine url -> batch requests sent there
        self._turn: collections.deque[str] = collections.deque()  # tenants in turn
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                             cookie_jar=aiohttp.DummyCookieJar())
        self._task = asyncio.create_task(self._loop(), name="kvfleet-batch-runner")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._sends) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their cancels, not this stop's own
        for batch_id in list(self.batches):
            await self.state.release(batch_id, self.owner)
        if self.session is not None:
            await self.session.close()

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        last_scan = 0.0
        while True:
            now = time.monotonic()
            if now - last_scan >= SCAN_S:
                last_scan = now
                try:
                    await self._scan()
                    if now - self._last_sweep >= SWEEP_S:
                        self._last_sweep = now
                        await self.sweep()
                except Exception:  # noqa: BLE001 - Redis away, a bad record: the next scan tries again
                    log.exception("batch scan failed")
            self._dispatch()
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._wake.wait()

    async def sweep(self) -> int:
        """Deletes the files whose expiry has passed (body, then record), but not the input of an unfinished batch
        (it expires once the batch is done); how many. Any replica may sweep: deleting twice is harmless."""
        active = await self.state.active_batch_ids()
        # each unfinished batch keeps at most one expired file (its input): past those, a full sweep's worth
        expired = await self.state.expired_files(self.clock(), SWEEP_FILES + len(active))
        if not expired:
            return 0
        inputs = set()
        for batch_id in active:
            fields = await self.state.batch(batch_id)
            if fields is not None:
                inputs.add(json.loads(fields["record"])["input_file_id"])
        deleted = 0
        for record in expired:
            if record.id in inputs:
                continue
            try:
                await asyncio.to_thread(self.files.delete, record.id)
            except OSError as err:  # the store away: the next sweep tries again
                log.warning("cannot delete the expired file %s now: %s", record.id, err)
                continue
            await self.state.remove_file(record)
            deleted += 1
        if deleted:
            log.info("deleted %d expired batch file(s)", deleted)
        return deleted

    # Holding batches

    async def _scan(self) -> None:
        for batch_id in await self.state.active_batch_ids():
            held = batch_id in self.batches
            if not await self.state.claim(batch_id, self.owner):
                if held:  # another replica took it over: this one stops sending its requests
                    self.batches.pop(batch_id).stopping = "lost"
                continue
            fields = await self.state.batch(batch_id)
            if fields is None:
                await self.state.finished(batch_id)
                continue
            running = self.batches.get(batch_id)
            if running is None:
                running = await self._take(batch_id, fields)
                if running is None:
                    continue
            await self._check(running, fields)
            if batch_id in self.batches:
                await self._report(running)

    async def _report(self, running: Running) -> None:
        """The batch's unfinished work for each fleet it runs on, for the operator's autoscaler (batch_demand.py)."""
        remaining = len(running.pending) + running.in_flight
        for fleet, (share, prompt, output) in running.shape.items():
            await self.state.report_backlog(fleet, running.id, {
                "remaining": math.ceil(remaining * share), "prompt_tokens": prompt, "output_tokens": output,
                "deadline": running.expires_at, "reported_at": self.clock()})

    async def _take(self, batch_id: str, fields: dict) -> Running | None:
        """Reads the batch's input and what is already answered; validates it first if it is new."""
        record = json.loads(fields["record"])
        status = fields["status"]
        if status in ("completed", "failed", "expired", "cancelled"):
            await self.state.finished(batch_id)
            await self.state.release(batch_id, self.owner)
            return None
        try:
            data = await asyncio.to_thread(self.files.read, record["input_file_id"])
        except (FileNotFoundError, ValueError):
            await self._fail(batch_id, "input_file_missing", f"the input file {record['input_file_id']} cannot be "
                                                             "read; it was deleted")
            return None
        except OSError as err:  # the store away: the batch waits, as it does for the engines
            log.warning("batch %s waits: its input file cannot be read now (%s)", batch_id, err)
            await self.state.release(batch_id, self.owner)
            return None
        try:
            cores = await self.models()
        except Exception as err:  # noqa: BLE001 - no engine answers yet: the next scan tries again
            log.info("batch %s waits: the served models cannot be read now (%s)", batch_id, err)
            await self.state.release(batch_id, self.owner)
            return None
        lines = await asyncio.to_thread(lambda: list(read_lines(data, record["endpoint"], cores.__contains__)))
        running = Running(batch_id, fields["tenant"], record["endpoint"], int(record["expires_at"]), cores,
                          output_ttl_s=record.get("output_expires_after"))
        if status == "validating" or "total" not in fields:  # new, or cancelled before it was validated
            for line in lines:
                if isinstance(line, LineError):
                    await self.state.answer(batch_id, f"line:{line.number}", _error_line(line), ok=False)
            await self.state.set_fields(batch_id, total=len(lines))
            await self.state.transition(batch_id, ("validating",), "in_progress", int(self.clock()))
        running.shape = _shape([line for line in lines if isinstance(line, Line)], cores)
        answered = await self.state.answered(batch_id)
        running.pending.extend((line, 0) for line in lines if isinstance(line, Line)
                               and line.custom_id not in answered)
        self.batches[batch_id] = running
        if running.tenant not in self._turn:
            self._turn.append(running.tenant)
        log.info("batch %s: %d requests to run", batch_id, len(running.pending))
        return running

    async def _check(self, running: Running, fields: dict) -> None:
        """A cancel, the window's end, or nothing left: stop sending and finish once nothing is in flight."""
        if fields["status"] == "cancelling" and running.stopping is None:
            running.stopping = "cancelled"
        elif fields["status"] in RUNNING and self.clock() >= running.expires_at and running.stopping is None:
            running.stopping = "expired"
        await self._write_answers(running)
        if running.in_flight or running.unwritten:
            return
        if running.stopping is not None or not running.pending:
            await self._finish(running)

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        errors = json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                        "line": None}]})
        await self.state.transition(batch_id, RUNNING, "failed", int(self.clock()), errors=errors)
        await self.state.finished(batch_id)
        await self.state.release(batch_id, self.owner)

    async def _finish(self, running: Running) -> None:
        end = running.stopping or "completed"
        for line, _ in running.pending:  # never sent: each gets its line in the error file
            await self.state.answer(running.id, line.custom_id, _error_line(LineError(
                line.number, line.custom_id, f"batch_{end}", f"the batch was {end} before this request ran")),
                ok=False)
        running.pending.clear()
        now = int(self.clock())
        if end == "completed" and not await self.state.transition(running.id, ("in_progress",), "finalizing", now):
            fields = await self.state.batch(running.id)
            if fields and fields["status"] == "cancelling":  # a cancel came between the check and now
                end = "cancelled"
        file_ids = await self._write_files(running)
        completed, failed = await self.state.counts(running.id)
        file_ids |= {"completed": completed, "failed": failed}  # the answers leave Redis; their counts stay
        if end == "completed":
            await self.state.transition(running.id, ("finalizing",), "completed", int(self.clock()), **file_ids)
        else:
            await self.state.transition(running.id, (*RUNNING, "cancelling"), end, int(self.clock()), **file_ids)
        await self.state.drop_answers(running.id)
        for fleet in running.shape:
            await self.state.report_backlog(fleet, running.id, None)
        await self.state.finished(running.id)
        await self.state.release(running.id, self.owner)
        self.batches.pop(running.id, None)
        log.info("batch %s %s", running.id, end)

    async def _write_files(self, running: Running) -> dict[str, str | int]:
        out: dict[str, str | int] = {}
        for ok, key, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
            answers = sorted(await self.state.answers(running.id, ok), key=lambda a: a["line"])
            if not answers:
                continue
            data = b"".join(json.dumps(a["out"]).encode() + b"\n" for a in answers)
            file_id = new_file_id()
            size = await asyncio.to_thread(self.files.put_from, file_id, io.BytesIO(data))
            now = int(self.clock())
            ttl = running.output_ttl_s or self.file_ttl_s
            await self.state.add_file(FileRecord(file_id, running.tenant, size, now, f"{running.id}_{suffix}.jsonl",
                                                 "batch_output", now + ttl if ttl else None))
            out[key] = file_id
        return out

    # Sending

    def _dispatch(self) -> None:
        """Fills the batch slots the fleet has free now, tenants in turn."""
        if not self.batches:
            return
        fleets = {id(core): core for running in self.batches.values() for core, _ in running.cores.values()}
        for fleet in fleets.values():
            targets = batch_targets(fleet.pool.snapshots(), sum(fleet.queue.counts().values()),
                                    dict(self.in_flight), fleet.config.saturation, self.room)
            while targets:
                found = self._next_line(fleet)
                if found is None:
                    break
                running, line, attempts = found
                url = max(targets, key=targets.get)
                targets[url] -= 1
                if targets[url] <= 0:
                    del targets[url]
                self._send(fleet, url, running, line, attempts)

    def _next_line(self, fleet: Any) -> tuple[Running, Line, int] | None:
        """The next request for this fleet: the tenant whose turn it is, its oldest batch with one waiting."""
        for _ in range(len(self._turn)):
            tenant = self._turn[0]
            self._turn.rotate(-1)
            for running in self.batches.values():
                if running.tenant != tenant or running.stopping or not running.pending:
                    continue
                line, attempts = running.pending[0]
                if running.cores[line.body["model"]][0] is not fleet:
                    continue
                running.pending.popleft()
                return running, line, attempts
        return None

    def _send(self, fleet: Any, url: str, running: Running, line: Line, attempts: int) -> None:
        running.in_flight += 1
        self.in_flight[url] += 1
        self._count_in_flight()
        fleet.pool.record_dispatch(url)
        task = asyncio.create_task(self._request(fleet, url, running, line, attempts))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _count_in_flight(self) -> None:
        if self.metrics is not None:
            self.metrics.batch_in_flight.set(sum(self.in_flight.values()))

    async def _request(self, fleet: Any, url: str, running: Running, line: Line, attempts: int) -> None:
        body = {**line.body, "model": running.cores[line.body["model"]][1]}
        if fleet.config.forward_priority:
            body["priority"] = BATCH_ENGINE_PRIORITY
        request_id = f"{running.id}-{line.number}"
        sent = {headers.REQUEST_ID: request_id}
        if fleet.config.engine_api_key:
            sent[headers.AUTHORIZATION] = f"Bearer {fleet.config.engine_api_key}"
        status, answer = 0, None
        try:
            async with self.session.post(url + running.endpoint, json=body, headers=sent) as response:
                status = response.status
                raw = await response.read()
            answer = json.loads(raw) if raw else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as err:
            log.info("batch %s line %d: %s: %s", running.id, line.number, url, err)
        finally:
            running.in_flight -= 1
            self.in_flight[url] -= 1
            if self.in_flight[url] <= 0:
                del self.in_flight[url]
            self._count_in_flight()
            # the engine's health as the proxy counts it: a failure to answer or a 5xx counts against it
            fleet.pool.record_done(url, status != 0 and status < 500 if status < 400 or status >= 500 else None)
        if status == 0 or status in RETRY_STATUSES:
            if attempts + 1 < MAX_ATTEMPTS and not running.stopping:
                running.pending.appendleft((line, attempts + 1))
                self.wake()
                return
        out = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
               "response": {"status_code": status, "request_id": request_id, "body": answer} if status else None,
               "error": None if status else {"code": "engine_unreachable",
                                             "message": f"no engine answered after {MAX_ATTEMPTS} tries"}}
        running.unwritten.append((line.custom_id, {"line": line.number, "out": out}, 200 <= status < 300))
        await self._write_answers(running)
        self.wake()

    async def _write_answers(self, running: Running) -> None:
        """Keeps the batch's new answers in Redis; while Redis is away they wait here (the scan tries again), so
        an answer is neither lost nor asked of the engine twice."""
        while running.unwritten:
            key, answer, ok = running.unwritten[0]
            try:
                kept = await self.state.answer(running.id, key, answer, ok)
            except RedisError as err:
                log.info("batch %s: %d answers wait for Redis: %s", running.id, len(running.unwritten), err)
                return
            running.unwritten.pop(0)
            if kept and self.metrics is not None:
                self.metrics.batch_requests.labels("completed" if ok else "failed").inc()


def _error_line(error: LineError) -> dict:
    """An error-file line for a request that never ran."""
    return {"line": error.number, "out": {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": error.custom_id,
                                          "response": None, "error": {"code": error.code, "message": error.message}}}




def _shape(lines: list[Line], cores: dict[str, tuple[Any, str]]) -> dict[str, tuple[float, float, float]]:
    """Per fleet (a gateway core's fleet name): its share of the lines, their mean prompt tokens (about four
    characters a token) and mean output tokens (max_tokens)."""
    sums: dict[str, list[float]] = {}
    for line in lines:
        fleet = cores[line.body["model"]][0].config.fleet
        prompt, output = token_estimate(line.body)
        acc = sums.setdefault(fleet, [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += prompt
        acc[2] += output
    return {fleet: (n / max(1, len(lines)), p / n, o / n) for fleet, (n, p, o) in sums.items()}
