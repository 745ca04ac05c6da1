"""A prompt far longer than the context is refused before it is tokenized: in milliseconds, and leaving no memory
behind (a real engine process, its resident memory read with psutil)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import start_engine_server, stop_process

HUGE = 6 * 1024 * 1024  # characters: under the 8 MiB body limit, far over any context


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    proc, url = start_engine_server(tiny_model_dir)
    yield psutil.Process(proc.pid), url
    stop_process(proc)


def rss(process: psutil.Process) -> int:
    return process.memory_info().rss


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text[: len(text) // 2]},
                                                        {"role": "user", "content": text[len(text) // 2:]}]},
     "messages"),
])
def test_huge_prompts_are_refused_fast_and_leave_no_memory(engine, path: str, body, param: str) -> None:
    process, url = engine
    with httpx.Client(base_url=url, timeout=60) as client:
        client.post(path, json=body("warm " * 10))  # first-use allocations are not a leak
        before = rss(process)
        for i in range(4):
            text = chr(ord("a") + i) * HUGE  # one character per token at best: far past 256 tokens
            started = time.monotonic()
            response = client.post(path, json=body(text))
            elapsed = time.monotonic() - started
            assert response.status_code == 400, response.text[:300]
            error = response.json()["error"]
            assert error["param"] == param and error["code"] == "context_length_exceeded"
            assert "maximum context length of 256 tokens" in error["message"]
            assert elapsed < 1.0, f"refusing a {HUGE}-character prompt took {elapsed:.2f} s"
        growth = rss(process) - before
        assert growth < 64 * 1024 * 1024, f"resident memory grew {growth / 2**20:.0f} MiB over four huge prompts"
        ok = client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_just_within_the_bound_is_still_tokenized_and_judged_by_tokens(engine) -> None:
    _, url = engine
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello " * 300, "max_tokens": 1}, timeout=60)
    assert response.status_code == 400
    assert "However, you requested" in response.json()["error"]["message"]  # counted in tokens, not characters
