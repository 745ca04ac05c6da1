"""Faults in the middle of a batch, with real processes: the gateway replica running it is SIGKILLed and another
takes it over when its lease lapses, and Redis (with its append-only file, as the chart's redis.persistence runs
it) restarts under the survivor. Every custom_id is answered exactly once: nothing lost, nothing twice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvfleet.local.redis_server import RedisServer
from tests.conftest import start_gateway, stop_process
from tests.support.batch import jsonl, request_line, wait_done
from tests.support.gateways import wait_until_routable

REQUESTS = 80


@pytest.fixture(scope="module")
def engine(batch_engine: str) -> str:
    return batch_engine


def replica(engine: str, redis_url: str, store: Path):
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_url, "--batch-dir", str(store),
                              "--data-plane", "python")
    wait_until_routable(url)
    return proc, url


def test_a_replica_killed_and_redis_restarted_mid_batch_lose_and_repeat_nothing(engine: str, tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    redis = RedisServer(append_only_dir=str(tmp_path / "redis")).start()
    store = tmp_path / "store"
    first, first_url = replica(engine, redis.url, store)
    second = None
    try:
        model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
        client = OpenAI(base_url=f"{first_url}/v1", api_key="none", max_retries=0, timeout=60)
        lines = [request_line(f"r{i}", model, f"Tell me about {i}", max_tokens=24) for i in range(REQUESTS)]
        uploaded = client.files.create(file=("work.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 5:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second, second_url = replica(engine, redis.url, store)  # waits: the first replica holds the batch
        first.kill()  # SIGKILL: no goodbye, its lease lapses
        first.wait(timeout=10)
        # the openai client's own retries (2 by default) ride out the second Redis is away (503, Retry-After)
        survivor = OpenAI(base_url=f"{second_url}/v1", api_key="none", max_retries=3, timeout=60)
        at_kill = survivor.batches.retrieve(batch.id).request_counts.completed
        assert at_kill < REQUESTS, "the batch ended before the kill; give it more work"
        deadline = time.monotonic() + 60
        while survivor.batches.retrieve(batch.id).request_counts.completed <= at_kill + 3:
            assert time.monotonic() < deadline, "the second replica never took the batch over"
            time.sleep(0.2)
        assert survivor.batches.retrieve(batch.id).status == "in_progress"
        redis.stop()  # Redis goes away under the survivor's runner, and comes back with its data
        away = httpx.get(f"{second_url}/v1/batches/{batch.id}", timeout=30)
        assert away.status_code == 503 and away.headers["retry-after"] == "2"
        assert "retry shortly" in away.json()["error"]["message"]
        time.sleep(1.0)
        redis.start()
        done = wait_done(survivor, batch.id, timeout_s=120)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            REQUESTS, REQUESTS, 0)
        answers = [json.loads(line) for line in survivor.files.content(done.output_file_id).text.splitlines()]
        ids = [a["custom_id"] for a in answers]
        assert sorted(ids) == sorted(f"r{i}" for i in range(REQUESTS))  # each exactly once
        assert all(a["response"]["status_code"] == 200 for a in answers)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                stop_process(proc)
        redis.stop()
