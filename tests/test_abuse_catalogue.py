"""The hostile-client catalogue (bench/abuse_catalogue.py) against a real gateway and two real tiny-model engines.

Each attack runs while honest clients (two streaming, two not) are in flight: the attacker gets the answer the
catalogue expects, every victim is answered in full with the same text as when alone, and both engines stay
healthy behind the gateway. bench/abuse.py runs the same catalogue against `kvfleet up` with SmolLM2.
"""

from __future__ import annotations

import httpx
import pytest

from bench.abuse import run_one, run_victims
from bench.abuse_catalogue import CATALOGUE, Target
from tests.conftest import process_output, start_engine_servers, start_gateway, stop_process


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    # a context long enough that the abandoned 2,000-token answer would keep an engine busy for many seconds
    flags = ("--max-num-seqs", "8", "--max-model-len", "2048", "--kv-cache-memory", "32MiB")
    engines = start_engine_servers(tiny_model_dir, flags, flags)
    # a 2 s header timeout so that the slowloris is cut off in seconds: the mechanism is the same at the default
    # 15 s (kvfleet/fleet/http_limits.py), which the catalogue's own run against `kvfleet up` (bench/abuse.py) keeps
    gateway, url = start_gateway(*(flag for _, e in engines for flag in ("--engine", e)), "--header-timeout", "2")
    model = httpx.get(engines[0][1] + "/v1/models", timeout=5).json()["data"][0]["id"]
    target = Target(url, model, [e for _, e in engines])
    alone = run_victims(url, model)
    assert all(v.status == 200 and v.finish_reason for v in alone), alone
    yield target, alone, [gateway, *(p for p, _ in engines)]
    for proc in (gateway, *(p for p, _ in engines)):
        stop_process(proc)


@pytest.mark.parametrize("attack", CATALOGUE, ids=[a.name for a in CATALOGUE])
def test_attack_gets_its_answer_and_harms_no_one(fleet, attack) -> None:
    target, alone, procs = fleet
    row = run_one(attack, target, [p.pid for p in procs], alone)
    assert row.passed, row
    forged = [line for proc in procs for line in process_output(proc).splitlines()
              if line.startswith("FORGED LOG LINE")]
    assert not forged, "a client's field name wrote its own line into a log"
