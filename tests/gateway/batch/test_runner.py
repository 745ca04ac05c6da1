"""The batch runner in process, against a real engine, a real gateway core and real Redis, with the clock in the
test's hands: a batch whose window ends keeps the answers given and ends `expired`, every request never sent an
error line of its own; and tenants take turns, so one tenant's many batches do not crowd out another's one."""

from __future__ import annotations

import asyncio
import collections
import io
import json
from pathlib import Path

import httpx
import pytest

from kvfleet.fleet.redis_keys import batch_backlog_key
from kvfleet.gateway.batch.files import put_bytes
from kvfleet.gateway.batch.lines import Line
from kvfleet.gateway.batch.runner import BatchRunner, Running
from kvfleet.gateway.batch.settings import BatchSettings
from kvfleet.gateway.batch.state import FileRecord
from kvfleet.gateway.batch.wire import BatchApi
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.core import Gateway
from kvfleet.local.redis_server import RedisServer
from tests.support.batch import jsonl, request_line


@pytest.fixture(scope="module")
def engine(batch_engine: str) -> str:
    return batch_engine


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        import time

        return time.time() + self.offset


async def until(check, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
async def test_a_batch_past_its_window_ends_expired_keeping_what_was_answered(engine: str, tmp_path: Path) -> None:
    redis = RedisServer().start()
    clock = Clock()
    gateway = Gateway(GatewayConfig(engines=[engine], redis_url=redis.url, data_plane="python",
                                    batch=BatchSettings(str(tmp_path))))
    await gateway.start()
    api = BatchApi(gateway, clock)
    api.start()
    try:
        model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
        data = jsonl([request_line(f"r{i}", model, max_tokens=48) for i in range(40)])
        put_bytes(api.files, "file-" + "0" * 24, data)
        await api.state.add_file(FileRecord("file-" + "0" * 24, "t", len(data), int(clock()), "in.jsonl", "batch"))
        batch = await api.service.create("t", {"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/chat/completions",
                                               "completion_window": "1m"})

        async def some_answered() -> bool:
            return (await api.service.retrieve("t", batch["id"]))["request_counts"]["completed"] >= 2

        await until(some_answered)
        # the runner reports the unfinished work for the operator's autoscaler (operator/batch_demand.py), at each
        # scan (once a second): until a scan has seen some of it answered
        reported: dict = {}

        async def reported_progress() -> bool:
            raw = await api.redis.hget(batch_backlog_key("default"), batch["id"])
            reported.update(json.loads(raw) if raw else {})
            return reported.get("remaining", 40) < 40

        await until(reported_progress)
        assert reported["remaining"] > 0 and reported["deadline"] == batch["expires_at"]
        assert reported["output_tokens"] == 48 and reported["prompt_tokens"] > 0
        clock.offset = 61.0  # the window has passed

        async def ended() -> bool:
            return (await api.service.retrieve("t", batch["id"]))["status"] not in ("in_progress", "validating")

        await until(ended)
        done = await api.service.retrieve("t", batch["id"])
        assert done["status"] == "expired" and done["expired_at"] >= done["expires_at"]
        counts = done["request_counts"]
        assert counts["total"] == 40 and 2 <= counts["completed"] < 40 and counts["completed"] + counts["failed"] == 40
        output = [json.loads(x) for x in api.files.read(done["output_file_id"]).splitlines()]
        errors = [json.loads(x) for x in api.files.read(done["error_file_id"]).splitlines()]
        assert len(output) == counts["completed"] and {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert sorted(a["custom_id"] for a in output + errors) == sorted(f"r{i}" for i in range(40))
        assert await api.redis.hget(batch_backlog_key("default"), batch["id"]) is None  # nothing left to plan for
    finally:
        await api.stop()
        await gateway.stop()
        redis.stop()


def test_tenants_take_turns_whatever_their_number_of_batches() -> None:
    runner = BatchRunner(state=None, files=None, models=None)
    fleet = object()
    for batch_id, tenant in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")):
        running = Running(batch_id, tenant, "/v1/completions", 0, {"m": (fleet, "m")})
        running.pending.extend((Line(k, f"{batch_id}-{k}", {"model": "m"}), 0) for k in range(4))
        runner.batches[batch_id] = running
        if tenant not in runner._turn:
            runner._turn.append(tenant)
    order = [runner._next_line(fleet)[0].tenant for _ in range(8)]
    assert collections.Counter(order) == {"a": 4, "b": 4}  # b's one batch runs as fast as a's three together
    assert order == ["a", "b"] * 4


@pytest.mark.asyncio
async def test_files_expire_when_they_say_and_an_unfinished_batchs_input_waits_for_it(engine: str,
                                                                                         tmp_path: Path) -> None:
    """OpenAI's retention: a file's expires_after (else --batch-file-ttl), a batch's output_expires_after for its
    output; a sweep deletes each expired file's body and record, but not the input of a batch still unfinished."""
    from starlette.datastructures import UploadFile

    redis = RedisServer().start()
    clock = Clock()
    gateway = Gateway(GatewayConfig(engines=[engine], redis_url=redis.url, data_plane="python", fleet="retention",
                                    batch=BatchSettings(str(tmp_path), file_ttl_s=7200)))
    await gateway.start()
    api = BatchApi(gateway, clock)  # its runner does not run: the test drives it
    try:
        model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
        data = jsonl([request_line("r0", model)])

        async def upload(expires_after: tuple[str, str] | None) -> dict:
            return await api.service.upload("t", UploadFile(io.BytesIO(data), filename="in.jsonl"), "batch",
                                            expires_after)

        hour = await upload(("created_at", "3600"))
        default = await upload(None)
        assert hour["expires_at"] == hour["created_at"] + 3600 and default["expires_at"] == default["created_at"] + 7200
        busy = await upload(("created_at", "3600"))
        await api.service.create("t", {"input_file_id": busy["id"], "endpoint": "/v1/chat/completions",
                                       "completion_window": "24h"})  # unfinished: no runner takes it
        clock.offset = 3601.0
        assert await api.runner.sweep() == 1
        assert {f["id"] for f in (await api.service.list_files("t", None, None, None, "asc"))["data"]} == {
            default["id"], busy["id"]}
        with pytest.raises(FileNotFoundError):
            api.files.read(hour["id"])
        assert api.files.read(busy["id"]) == data  # it expires once its batch is done
        clock.offset = 7201.0
        assert await api.runner.sweep() == 1 and api.files.read(busy["id"]) == data
        assert [f["id"] for f in (await api.service.list_files("t", None, None, None, "asc"))["data"]] == [busy["id"]]
    finally:
        await api.stop()
        await gateway.stop()
        redis.stop()


@pytest.mark.asyncio
async def test_a_batchs_output_files_expire_as_it_asked(engine: str, tmp_path: Path) -> None:
    redis = RedisServer().start()
    gateway = Gateway(GatewayConfig(engines=[engine], redis_url=redis.url, data_plane="python", fleet="outputs",
                                    batch=BatchSettings(str(tmp_path))))
    await gateway.start()
    api = BatchApi(gateway)
    api.start()
    try:
        model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
        data = jsonl([request_line("r0", model), request_line("r1", "no-such-model")])
        put_bytes(api.files, "file-" + "1" * 24, data)
        await api.state.add_file(FileRecord("file-" + "1" * 24, "t", len(data), 0, "in.jsonl", "batch"))
        batch = await api.service.create("t", {"input_file_id": "file-" + "1" * 24, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h",
                                               "output_expires_after": {"anchor": "created_at", "seconds": 3600}})

        async def done() -> bool:
            return (await api.service.retrieve("t", batch["id"]))["status"] == "completed"

        await until(done)
        finished = await api.service.retrieve("t", batch["id"])
        for file_id in (finished["output_file_id"], finished["error_file_id"]):
            record = await api.service.own_file("t", file_id)
            assert record.expires_at == record.created_at + 3600
    finally:
        await api.stop()
        await gateway.stop()
        redis.stop()


class NoBatches:
    """A batch state with nothing in it: the runner's loop scans, finds nothing and waits."""

    async def active_batch_ids(self) -> list[str]:
        return []

    async def expired_files(self, now: float, limit: int) -> list:
        return []


@pytest.mark.asyncio
async def test_a_runner_woken_in_the_moment_it_is_stopped_still_stops() -> None:
    """A gateway's shutdown (and CI once, for 70 minutes) waited on a runner whose wait for work ended in the moment
    it was cancelled: on Python 3.11 asyncio.wait_for then returns instead of passing the cancel on."""
    for _ in range(5):
        runner = BatchRunner(NoBatches(), files=None, models=None)
        runner.start()
        await asyncio.sleep(0.2)  # in its wait for work, between scans
        runner.wake()
        stopping = asyncio.create_task(runner.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert stopping in done, "the runner did not stop"
