"""SIGTERM drains: /ready turns false, the in-flight stream runs to its end, then the process exits 0."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx

from tests.conftest import process_output, start_engine_server


def readiness(base: str) -> int | None:
    """/ready's status; None once the listener has closed (not ready either)."""
    try:
        return httpx.get(f"{base}/ready", timeout=2).status_code
    except httpx.TransportError:
        return None


def test_sigterm_finishes_in_flight_requests_then_exits_zero(tiny_model_dir: Path) -> None:
    proc, base = start_engine_server(tiny_model_dir)
    try:
        body = {"prompt": [3] * 20, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
        texts, finish = [], None
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if not texts:
                    proc.send_signal(signal.SIGTERM)
                    deadline = time.monotonic() + 10  # once the signal is handled, however busy the machine
                    while (ready := readiness(base)) == 200 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert ready in (503, None)
                texts.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
        assert finish == "length"
        assert proc.wait(timeout=60) == 0
        log = process_output(proc)
        assert "completion_tokens=120" in log and "finish_reason=length" in log  # its request log line
        assert "draining in-flight requests" in log
    finally:
        if proc.poll() is None:
            proc.kill()
