"""The OpenAI Batch API on the gateway, driven by the official `openai` client unchanged: upload a JSONL file, create
a batch, poll it, download its output and error files. Real parts: a tiny-model engine, the gateway process, Redis.
Every bad line is one error-file entry naming its line while the rest runs; each custom_id is answered once; a
tenant sees only its own files and batches; uploads and batch floods are bounded with clear 4xx answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from kvfleet.local.redis_server import RedisServer
from tests.conftest import start_gateway, stop_process
from tests.support.batch import client, jsonl, output_lines, request_line, wait_done
from tests.support.gateways import wait_until_routable

MAX_FILE_BYTES = 64 * 1024
MAX_ACTIVE = 3


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def engine(batch_engine: str) -> str:
    return batch_engine


@pytest.fixture(scope="module")
def model(engine: str) -> str:
    return httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def gateway(engine: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("batch-store")
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_url, "--batch-dir", str(store),
                              "--batch-max-file-bytes", str(MAX_FILE_BYTES), "--batch-max-active", str(MAX_ACTIVE))
    wait_until_routable(url)
    yield url
    stop_process(proc)


def test_a_batch_runs_through_the_openai_client_and_every_bad_line_is_its_own_error(gateway: str, model: str) -> None:
    c = client(gateway)
    good = [request_line(f"req-{i}", model, f"Count to {i}") for i in range(12)]
    lines = [*good[:4], b"{not json", {**request_line("wrong-url", model), "url": "/v1/completions"},
             request_line("no-model", "no-such-model"), request_line("req-0", model),  # a duplicate custom_id
             {**request_line("stream", model), "body": {**request_line("s", model)["body"], "stream": True}},
             ["not", "an", "object"], *good[4:]]
    uploaded = c.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines)) and uploaded.filename == "requests.jsonl"
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    done = wait_done(c, batch.id)
    assert done.status == "completed" and done.completed_at and done.output_file_id and done.error_file_id
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (18, 12, 6)
    answers = output_lines(c, done.output_file_id)
    assert sorted(a["custom_id"] for a in answers) == sorted(line["custom_id"] for line in good)  # each once
    assert all(a["response"]["status_code"] == 200 and a["response"]["body"]["choices"][0]["message"]["content"]
               for a in answers)
    errors = {e["error"]["code"]: e for e in output_lines(c, done.error_file_id)}
    assert set(errors) == {"invalid_json", "mismatched_endpoint", "model_not_found", "duplicate_custom_id",
                           "invalid_body", "invalid_request"}
    assert errors["invalid_json"]["error"]["message"].startswith("line 5:")
    assert errors["duplicate_custom_id"]["custom_id"] == "req-0"
    assert "no-such-model" in errors["model_not_found"]["error"]["message"]
    listed = c.batches.list(limit=5)
    assert listed.data[0].id == batch.id
    output = c.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output"


def test_a_tenant_sees_only_its_own_files_and_batches(gateway: str, model: str) -> None:
    mine, theirs = client(gateway, "team-a"), client(gateway, "team-b")
    uploaded = mine.files.create(file=("x.jsonl", jsonl([request_line("a", model)])), purpose="batch")
    batch = mine.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: theirs.files.retrieve(uploaded.id), lambda: theirs.files.content(uploaded.id),
                 lambda: theirs.files.delete(uploaded.id), lambda: theirs.batches.retrieve(batch.id),
                 lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert uploaded.id not in {f.id for f in theirs.files.list()}
    assert batch.id not in {b.id for b in theirs.batches.list()}
    wait_done(mine, batch.id)


@pytest.mark.parametrize(("make", "status", "says"), [
    (lambda c, m: c.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch"), 413,
     "split"),
    (lambda c, m: c.files.create(file=("a.jsonl", jsonl([request_line("a", m)])), purpose="fine-tune"), 400,
     "purpose"),
    (lambda c, m: c.files.create(file=("e.jsonl", b"\n\n"), purpose="batch"), 400, "1 to"),
    (lambda c, m: c.batches.create(input_file_id="file-000000000000000000000000", endpoint="/v1/chat/completions",
                                   completion_window="24h"), 404, "No file"),
    (lambda c, m: c.batches.create(input_file_id="../../etc/passwd", endpoint="/v1/chat/completions",
                                   completion_window="24h"), 404, "No file"),
    (lambda c, m: c.batches.create(input_file_id=upload(c, m), endpoint="/v1/embeddings", completion_window="24h"),
     400, "endpoint"),
    (lambda c, m: c.batches.create(input_file_id=upload(c, m), endpoint="/v1/chat/completions",
                                   completion_window="2d"), 400, "completion_window"),
    (lambda c, m: c.batches.create(input_file_id=upload(c, m), endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={str(i): "v" for i in range(17)}), 400,
     "metadata"),
    (lambda c, m: c.files.create(file=("a.jsonl", jsonl([request_line("a", m)])), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 60}), 400, "expires_after"),
    (lambda c, m: c.files.create(file=("a.jsonl", jsonl([request_line("a", m)])), purpose="batch",
                                 expires_after={"anchor": "last_active_at", "seconds": 3600}), 400, "expires_after"),
    (lambda c, m: c.batches.create(input_file_id=upload(c, m), endpoint="/v1/chat/completions",
                                   completion_window="24h", output_expires_after={"anchor": "created_at",
                                                                                  "seconds": 10 ** 9}), 400,
     "output_expires_after"),
    (lambda c, m: c.batches.retrieve("batch_nope"), 404, "No batch"),
    (lambda c, m: c.batches.list(limit=1000), 400, "limit"),
])
def test_hostile_calls_get_a_clear_4xx(gateway: str, model: str, make, status: int, says: str) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        make(client(gateway, "hostile"), model)
    assert refused.value.status_code == status and says in refused.value.message


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"input_file_id": "%s", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
     b'"metadata": {"k": "\\ud800"}}', "surrogate"),
    (b'{"input_file_id": ' + b"[" * 200 + b"]" * 200 + b"}", "nests deeper"),
    (b"\xff\xfe not json", "not valid JSON"),
])
def test_a_body_that_is_not_unicode_json_gets_a_400(gateway: str, model: str, raw: bytes, says: str) -> None:
    c = client(gateway, "hostile")
    if b"%s" in raw:
        raw = raw.replace(b"%s", upload(c, model).encode())
    refused = httpx.post(f"{gateway}/v1/batches", content=raw, headers={"x-kvfleet-tenant": "hostile"}, timeout=30)
    assert refused.status_code == 400 and says in refused.json()["error"]["message"]
    assert not [b for b in c.batches.list().data if b.metadata]  # nothing was kept


def upload(c: OpenAI, model: str) -> str:
    return c.files.create(file=("a.jsonl", jsonl([request_line("a", model)])), purpose="batch").id


def test_a_flood_of_batches_is_capped_per_tenant_and_a_finished_batch_cannot_be_cancelled(gateway: str,
                                                                                        model: str) -> None:
    c = client(gateway, "flooder")
    slow = [request_line(f"s{i}", model, max_tokens=64) for i in range(8)]
    file_id = c.files.create(file=("slow.jsonl", jsonl(slow)), purpose="batch").id
    batches = [c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
               for _ in range(MAX_ACTIVE)]
    with pytest.raises(openai.RateLimitError) as capped:
        c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "unfinished" in capped.value.message
    other = client(gateway, "bystander")  # another tenant is not capped by the flooder
    other.batches.create(input_file_id=upload(other, model), endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = c.batches.cancel(batches[0].id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait_done(c, batches[0].id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.completed + counts.failed == 8  # every request answered: run, or `batch_cancelled`
    codes = {e["error"]["code"] for e in output_lines(c, done.error_file_id) if e["error"]}
    assert codes <= {"batch_cancelled"}
    for b in batches[1:]:
        assert wait_done(c, b.id).status == "completed"
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batches[1].id)


def test_the_batch_api_answers_through_envoy_too(engine: str, redis_url: str, model: str, tmp_path: Path) -> None:
    """With Envoy carrying the bytes, /v1/files and /v1/batches go to the gateway's own app (uploads included)."""
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_url, "--batch-dir", str(tmp_path),
                              "--data-plane", "envoy", "--fleet", "through-envoy", "--batch-max-file-bytes",
                              str(MAX_FILE_BYTES), timeout=90.0)
    try:
        wait_until_routable(url)
        c = client(url, "envoy-tenant")
        uploaded = c.files.create(file=("e.jsonl", jsonl([request_line(f"e{i}", model) for i in range(3)])),
                                  purpose="batch")
        done = wait_done(c, c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.completed == 3
        assert len(output_lines(c, done.output_file_id)) == 3
        with pytest.raises(openai.APIStatusError) as big:
            c.files.create(file=("big.jsonl", b"x" * (4 * MAX_FILE_BYTES)), purpose="batch")
        assert big.value.status_code == 413
    finally:
        stop_process(proc)


def test_batch_tokens_are_limited_per_key_apart_from_interactive_limits(redis_url: str, model: str,
                                                                        tmp_path: Path) -> None:
    """OpenAI's batch queue limit: a key's tenant may have so many tokens (prompt estimate + max_tokens) enqueued in
    unfinished batches (its key's batch_tokens=, else --batch-max-tokens). Its engine never answers here, so every
    batch stays unfinished and holds its tokens."""
    keys = tmp_path / "keys"
    keys.write_text("sk-small name=small batch_tokens=300 rpm=1\nsk-big name=big\n")
    proc, url = start_gateway("--engine", "http://127.0.0.1:9", "--redis-url", redis_url, "--batch-dir",
                              str(tmp_path / "files"), "--api-keys-file", str(keys), "--batch-max-tokens", "100000",
                              "--fleet", "token-limits")
    try:
        small = OpenAI(base_url=f"{url}/v1", api_key="sk-small", max_retries=0, timeout=60)
        lines = jsonl([request_line(f"t{i}", model, max_tokens=50) for i in range(3)])  # ~3 × (50 + ~18)
        first = small.files.create(file=("a.jsonl", lines), purpose="batch")
        second = small.files.create(file=("b.jsonl", lines), purpose="batch")  # rpm=1 does not count batch calls
        held = small.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert held.status == "validating"
        with pytest.raises(openai.RateLimitError) as full:
            small.batches.create(input_file_id=second.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert full.value.body["code"] == "token_limit_exceeded" and "wait for a batch" in full.value.message
        assert full.value.response.headers["retry-after"]
        big_file = small.files.create(file=("c.jsonl", jsonl([request_line(f"b{i}", model, max_tokens=100)
                                                              for i in range(4)])), purpose="batch")
        with pytest.raises(openai.BadRequestError) as alone:
            small.batches.create(input_file_id=big_file.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert "split it into smaller batches" in alone.value.message
        # another key's tenant has the gateway's limit, and its own tokens
        big = OpenAI(base_url=f"{url}/v1", api_key="sk-big", max_retries=0, timeout=60)
        mine = big.files.create(file=("d.jsonl", lines), purpose="batch")
        assert big.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").status == "validating"
    finally:
        stop_process(proc)
