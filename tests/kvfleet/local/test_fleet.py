"""`kvfleet up`: a real embedded Redis, real engine processes and a real gateway, started and stopped as a user
would (a subprocess, then SIGTERM or Ctrl-C). Bad inputs tried: --engines 0, a --port already in use."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvfleet.local.fleet import FleetSpec, LocalFleet
from tests.conftest import free_port
from tests.support.commands import listening, start_up
from tests.support.gateways import wait_until_routable


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_through_the_gateway_and_stops_everything_on_a_signal(tiny_model_dir, stop_signal) -> None:
    port = free_port()
    proc, lines = start_up(tiny_model_dir, port)
    out = "".join(lines)
    engines = re.findall(r"engine-\d ready at (http://\S+)", out)
    redis_url = re.search(r"Redis (redis://\S+),", out).group(1)
    gateway = f"http://127.0.0.1:{port}"
    try:
        assert len(engines) == 2 and f"fleet is up: {gateway}" in out
        wait_until_routable(gateway, 2)
        client = OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=60)
        served = set()
        for i in range(6):
            raw = client.chat.completions.with_raw_response.create(
                model=str(tiny_model_dir), messages=[{"role": "user", "content": f"question {i} " * 20}],
                max_tokens=4)
            assert raw.parse().choices[0].message.content is not None
            served.add(raw.headers["x-kvfleet-engine"])
        assert served <= set(engines) and served
        assert httpx.get(f"{gateway}/ready").json()["queue"] == "redis"
        # The engines answer only the gateway: /v1/* needs the run's token, which only the run's owner can read.
        token_file = Path(re.search(r"curl -H @(\S+)", out).group(1))
        assert token_file.stat().st_mode & 0o777 == 0o600
        name, _, value = token_file.read_text().strip().partition(": ")
        body = {"model": str(tiny_model_dir), "prompt": "Hi", "max_tokens": 2}
        refused = httpx.post(f"{engines[0]}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{engines[0]}/v1/completions", json=body, headers={name: value}, timeout=60).status_code \
            == 200
    finally:
        proc.send_signal(stop_signal)
        code = proc.wait(timeout=60)
    assert code == 0
    assert not any(listening(u) for u in [gateway, *engines, redis_url])  # nothing left running


def test_up_serves_two_models_through_one_gateway(tiny_model_dir) -> None:
    port = free_port()
    proc, lines = start_up(tiny_model_dir, port, 1, "small=smollm2-135m-instruct")
    gateway = f"http://127.0.0.1:{port}"
    try:
        out = "".join(lines)
        assert "one fleet per model" in out and out.count("ready at") == 3  # two engines and the gateway
        wait_until_routable(gateway, 2)
        client = OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=60)
        models = (str(tiny_model_dir), "small")  # NAME=MODEL: SmolLM2 served as `small`
        assert sorted(m.id for m in client.models.list().data) == sorted(models)
        engines = set()
        for model in models:
            raw = client.completions.with_raw_response.create(model=model, prompt="The capital of France is",
                                                              max_tokens=3, temperature=0)
            assert raw.parse().model == model
            engines.add(raw.headers["x-kvfleet-engine"])
        assert len(engines) == 2  # each model's own engine
        # The Batch API, as the README shows it: one batch whose lines name either model
        lines = [{"custom_id": f"{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": models[i % 2], "prompt": "The capital of France is", "max_tokens": 3,
                           "temperature": 0}} for i in range(4)]
        uploaded = client.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.3)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 4
        answers = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        assert {a["custom_id"]: a["response"]["body"]["model"] for a in answers} == {
            f"{i}": models[i % 2] for i in range(4)}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_up_refuses_bad_settings_with_a_message(tiny_model_dir) -> None:
    r = subprocess.run([sys.executable, "-m", "kvfleet.cli", "up", "--engines", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--engines must be between 1 and 64" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvfleet.cli", "up", "--model", str(tiny_model_dir), "--port",
                            str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"port {port}" in r.stderr and "--port" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvfleet.cli", "up", "--model", "a", "--model", "a"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "each model name once" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvfleet.cli", "up", "--routing", "nearest"], capture_output=True,
                       text=True, timeout=60)  # the choices are the gateway's own: prefix-affinity among them
    assert r.returncode == 2 and "'nearest'" in r.stderr and "prefix-affinity" in r.stderr


def test_each_run_has_its_own_engine_token() -> None:
    first, second = LocalFleet(FleetSpec()), LocalFleet(FleetSpec())
    assert len(first.engine_api_key) >= 32 and first.engine_api_key != second.engine_api_key


def test_an_engine_that_exits_starts_again_on_its_port_after_a_growing_back_off(tmp_path) -> None:
    """Stand-in engines (short Python processes: what matters is the restart, not the engine; the real one is
    restarted in tests/kvfleet/local/test_vllm_fleet.py): the first exit restarts at once, the next ones after 10 s,
    20 s, ..., an engine that ran 10 minutes starts its back-off over; the last run's log is kept beside the new one."""
    fleet = LocalFleet(FleetSpec())
    argv = [sys.executable, "-c", "import os, sys; print('run', os.getpid()); sys.exit(3)"]
    first = fleet._spawn("engine-0", argv, "http://127.0.0.1:1", {})
    fleet.engines = [first]
    try:
        first.wait(timeout=30)
        t0 = time.monotonic()
        assert fleet.restart_exited(t0) == ["engine-0"]  # the first exit: at once
        second = fleet.engines[0]
        assert second is not first and second.url == first.url
        assert f"run {first.pid}" in (fleet.run_dir / "engine-0.previous.log").read_text()
        second.wait(timeout=30)
        assert fleet.restart_exited(t0 + 1) == []  # its second exit in a row (seen at t0 + 1): 10 s
        assert fleet.restart_exited(t0 + 10.9) == [] and fleet.restart_exited(t0 + 11) == ["engine-0"]
        fleet.engines[0].wait(timeout=30)
        assert fleet.restart_exited(t0 + 12) == [] and fleet.restart_exited(t0 + 31.9) == []  # then 20 s
        assert fleet.restart_exited(t0 + 32) == ["engine-0"]
        assert fleet.launches["engine-0"].restarts == 3
        fleet.engines[0].wait(timeout=30)
        assert fleet.restart_exited(t0 + 32 + 700) == ["engine-0"]  # it ran 10 minutes: at once again
        assert f"run {fleet.engines[0].pid}" not in (fleet.run_dir / "engine-0.previous.log").read_text()
    finally:
        fleet.stop()


def test_restart_back_off_is_a_kubelets_from_no_wait() -> None:
    from kvfleet.local.fleet import restart_delay_s

    assert [restart_delay_s(n) for n in range(1, 10)] == [0, 10, 20, 40, 80, 160, 300, 300, 300]
