"""The Batch API with its files in an S3-compatible bucket (`kvfleet gateway --batch-store s3://BUCKET/PREFIX`): the
`openai` client's upload, batch and download work unchanged, the bodies are objects in the bucket (none on local
disk), a wrong bucket stops the gateway at start with a message, and a store that goes away answers 503 with
Retry-After, recording nothing. Real parts: a tiny-model engine, the gateway process, Redis, and moto's S3 server
(an emulator of S3's HTTP API: tests/support/s3_server.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from kvfleet.local.redis_server import RedisServer
from tests.conftest import start_gateway, stop_process
from tests.support.batch import client, jsonl, output_lines, request_line, wait_done
from tests.support.gateways import wait_until_routable
from tests.support.s3_server import S3Server

BUCKET = "kvfleet-batch"


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(batch_engine: str, s3: S3Server):
    redis = RedisServer().start()
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3.env().items():
            env.setenv(name, value)
        proc, url = start_gateway("--engine", batch_engine, "--redis-url", redis.url,
                                  "--batch-store", f"s3://{BUCKET}/batches")
    wait_until_routable(url)
    yield url
    stop_process(proc)
    redis.stop()


def test_a_batch_runs_with_its_files_in_the_bucket(gateway: str, s3: S3Server, batch_engine: str) -> None:
    model = httpx.get(f"{batch_engine}/v1/models").json()["data"][0]["id"]
    c = client(gateway)
    upload = c.files.create(file=("work.jsonl", jsonl([request_line(f"r{k}", model) for k in range(3)]
                                                       + ["not json"])), purpose="batch")
    assert f"batches/{upload.id}.jsonl" in s3.keys(BUCKET)
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_done(c, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3 and done.request_counts.failed == 1
    assert sorted(o["custom_id"] for o in output_lines(c, done.output_file_id)) == ["r0", "r1", "r2"]
    assert [e["error"]["code"] for e in output_lines(c, done.error_file_id)] == ["invalid_request"]
    assert {f"batches/{f}.jsonl" for f in (upload.id, done.output_file_id, done.error_file_id)} <= set(s3.keys(BUCKET))
    c.files.delete(upload.id)
    assert f"batches/{upload.id}.jsonl" not in s3.keys(BUCKET)


def test_a_bucket_that_does_not_exist_stops_the_gateway_at_start_with_a_message(s3: S3Server,
                                                                                 batch_engine: str) -> None:
    redis = RedisServer().start()
    try:
        done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "gateway", "--engine", batch_engine,
                               "--port", "0", "--redis-url", redis.url, "--batch-store", "s3://no-such-bucket/x"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, **s3.env()})
    finally:
        redis.stop()
    assert done.returncode != 0
    assert "no-such-bucket" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("url", ["gs://bucket/x", "s3://", "file:///tmp/x"])
def test_a_store_url_that_is_not_s3_is_refused_with_what_to_write(url: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "gateway", "--engine", "http://127.0.0.1:9",
                           "--redis-url", "redis://127.0.0.1:9", "--batch-store", url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "s3://BUCKET" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_store_that_goes_away_answers_503_with_retry_after_and_records_nothing(gateway: str, s3: S3Server,
                                                                                 batch_engine: str) -> None:
    """Last in the module: it stops the S3 server."""
    model = httpx.get(f"{batch_engine}/v1/models").json()["data"][0]["id"]
    c = client(gateway)
    kept = c.files.create(file=("a.jsonl", jsonl([request_line("a", model)])), purpose="batch")
    before = {f.id for f in c.files.list()}
    s3.stop()
    body = jsonl([request_line("b", model)])
    refused = httpx.post(f"{gateway}/v1/files", files={"file": ("b.jsonl", body)}, data={"purpose": "batch"},
                         headers={"x-kvfleet-tenant": "team-a"}, timeout=120)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "batch_store_unavailable"
    content = httpx.get(f"{gateway}/v1/files/{kept.id}/content", headers={"x-kvfleet-tenant": "team-a"}, timeout=120)
    assert content.status_code == 503
    assert {f.id for f in c.files.list()} == before  # the refused upload left no record
    assert httpx.get(f"{gateway}/ready", timeout=10).status_code == 200  # interactive serving is not affected

