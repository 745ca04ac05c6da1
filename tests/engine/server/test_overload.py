"""A full waiting queue answers 429 with Retry-After; everything admitted is still served."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.conftest import start_engine_server


def test_queue_overflow_gets_429_with_retry_after_and_the_rest_complete(tiny_model_dir: Path) -> None:
    proc, base = start_engine_server(tiny_model_dir, "--max-num-seqs", "1", "--max-num-waiting", "1")
    try:
        body = {"prompt": [8] * 10, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(9) as pool:
            futures = [pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=120) for _ in range(8)]
            peak_running = peak_waiting = 0
            while not all(f.done() for f in futures):  # metrics under load: one running, one waiting
                text = httpx.get(f"{base}/metrics", timeout=10).text
                peak_running = max(peak_running, _gauge(text, "kvfleet_num_requests_running"))
                peak_waiting = max(peak_waiting, _gauge(text, "kvfleet_num_requests_waiting"))
            responses = [f.result() for f in futures]
        assert (peak_running, peak_waiting) == (1, 1)
        rejected = _gauge(httpx.get(f"{base}/metrics").text, 'kvfleet_requests_rejected_total{reason="queue_full"}')
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        assert rejected == codes.count(429)
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert "waiting queue is full (1 requests); retry later" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 80
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_critical_request_preempts_a_running_standard_one_on_a_full_engine(tiny_model_dir: Path) -> None:
    proc, base = start_engine_server(tiny_model_dir, "--max-num-seqs", "1", "--max-model-len", "1024")
    try:
        long_body = {"prompt": [8] * 10, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            standard = pool.submit(httpx.post, f"{base}/v1/completions", json=long_body, timeout=120)
            deadline = time.monotonic() + 60
            while _gauge(httpx.get(f"{base}/metrics", timeout=10).text, "kvfleet_num_requests_running") < 1:
                assert time.monotonic() < deadline and not standard.done(), standard.result().text[:300]
                time.sleep(0.01)  # until the standard request holds the engine's only slot
            critical = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "prompt": [9] * 10, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "priority": -1})
            assert critical.status_code == 200 and critical.json()["usage"]["completion_tokens"] == 8
            assert not standard.done(), "the critical request waited for the 1000-token one to finish"
            finished = standard.result()
        assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 1000
        assert _gauge(httpx.get(f"{base}/metrics").text, "kvfleet_num_preemptions_total") >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
