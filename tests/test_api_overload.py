"""A full waiting queue answers 429 with Retry-After; everything admitted is still served."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.conftest import start_engine_server


def test_queue_overflow_gets_429_with_retry_after_and_the_rest_complete(tiny_model_dir: Path) -> None:
    proc, base = start_engine_server(tiny_model_dir, "--max-num-seqs", "1", "--max-num-waiting", "1")
    try:
        body = {"prompt": [8] * 10, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: httpx.post(f"{base}/v1/completions", json=body, timeout=120),
                                      range(8)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert "waiting queue is full (1 requests); retry later" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 80
    finally:
        proc.terminate()
        proc.wait(timeout=30)
