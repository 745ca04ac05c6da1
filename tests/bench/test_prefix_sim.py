"""The prefix-routing simulator (bench/prefix_sim/): requests are conserved, the engines' real prefix caches decide
hits, every replica's event-fed index ends up equal to what the engines hold, prefix-aware policies hit more than
round-robin where capacity binds, runs are reproducible, and the CLI writes its table, JSON and chart. Small fleets,
pure Python: seconds."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import bench.prefix_sim.__main__ as cli
from bench.prefix_sim import (
    POLICIES,
    Calibration,
    EngineShape,
    FleetShape,
    WorkloadShape,
    fleet_capacity_rps,
    poisson_trace,
    simulate,
    summarize,
)
from bench.prefix_sim.peers import SGLANG
from bench.prefix_sim.report import herding_index
from kvfleet.gateway.routing.router import Router

CALIBRATION = Calibration(2000.0, {1: 0.01, 16: 0.02})
# 12 tenants of ~300-400 tokens (20-25 blocks); each engine caches ~5 of them beside its batch: capacity binds
WORKLOAD = WorkloadShape(tenants=12, system_tokens=(300, 400), question_tokens=(20, 30), output_tokens=(4, 8))
FLEET = FleetShape(engines=4, replicas=2, engine=EngineShape(num_blocks=160, max_num_seqs=4))
DURATION = 14.0


def run(policy: str, load: float = 0.5, seed: int = 0):
    capacity = fleet_capacity_rps(FLEET, WORKLOAD.mean_prompt_tokens, sum(WORKLOAD.system_tokens) / 2,
                                  WORKLOAD.mean_output_tokens, CALIBRATION, 0.1)
    trace = poisson_trace(WORKLOAD, load * capacity, DURATION, seed, ramp_s=4.0)
    return simulate(trace, policy, FLEET, CALIBRATION, DURATION, seed)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_request_gets_one_engine_and_a_first_token_no_sooner_than_its_prefill(policy: str) -> None:
    result = run(policy)
    assert result.jobs
    for job in result.jobs:
        assert 0 <= job.engine < FLEET.engines and job.first_token is not None
        uncached = job.seq.num_prompt_tokens - job.hit_tokens
        assert job.first_token - job.arrival.at >= uncached / CALIBRATION.prefill_tokens_per_s - 1e-9
        assert job.hit_tokens % FLEET.engine.block_size == 0 and job.hit_tokens < job.seq.num_prompt_tokens
    assert sum(1 for j in result.jobs if j.hit_tokens) > 0


@pytest.mark.parametrize("policy", ["precise", "estimated-ttft"])
def test_every_replica_index_ends_equal_to_the_engines_caches(policy: str) -> None:
    result = run(policy)
    evicted = False
    for replica in result.routers:
        replica.take_events(math.inf)  # every event delivered
        for engine in result.engines:
            assert replica.prefix.index.size(engine.url) == len(engine.blocks.cached_blocks)
            evicted |= engine.blocks_published > len(engine.blocks.cached_blocks)
    assert evicted, "the KV budget should be too small to keep every tenant's prefix"


def test_prefix_aware_routing_hits_more_than_round_robin_when_capacity_binds() -> None:
    figures = {p: summarize(run(p, load=0.6), 4.0, DURATION) for p in
               ("round-robin", "approximate prefix", "precise", "oracle scoring")}
    rr, precise = figures["round-robin"]["prefix_hit_rate"], figures["precise"]["prefix_hit_rate"]
    assert precise > rr + 0.15 and figures["approximate prefix"]["prefix_hit_rate"] > rr + 0.1
    assert precise >= 0.9 * figures["oracle scoring"]["prefix_hit_rate"]  # the target, met on a small fleet
    assert figures["precise"]["ttft_mean_s"] < figures["round-robin"]["ttft_mean_s"]
    assert figures["precise"]["index_entries_per_replica"] > 0 and figures["precise"]["index_bytes_per_replica"] > 0
    assert figures["precise"]["kv_events_per_s_per_replica"] > 0


def test_the_same_seed_gives_the_same_figures() -> None:
    first, second = (summarize(run("precise", seed=3), 4.0, DURATION) for _ in range(2))
    assert first == second
    assert summarize(run("precise", seed=4), 4.0, DURATION) != first


def test_herding_index_is_engines_when_one_engine_takes_every_window() -> None:
    result = run("round-robin")
    assert herding_index(result, 4.0, DURATION)[1] == pytest.approx(1.0, abs=0.5)
    for job in result.jobs:
        job.engine = 0
    index, versus_even = herding_index(result, 4.0, DURATION)
    assert index == pytest.approx(FLEET.engines) and versus_even >= 1.0


def test_calibration_interpolates_between_measured_batches_and_rejects_nonsense(tmp_path: Path) -> None:
    assert CALIBRATION.step_s(1) == 0.01 and CALIBRATION.step_s(16) == 0.02
    assert 0.01 < CALIBRATION.step_s(8) < 0.02 and CALIBRATION.step_s(32) > 0.02
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"prefill_tokens_per_s": 20000, "decode_step_s": {"1": 0.006, "64": 0.012}}))
    assert Calibration.load(path).step_s(64) == 0.012
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Calibration(0.0, {1: 0.01})


def test_cli_writes_table_json_and_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"prefill_tokens_per_s": 3000, "decode_step_s": {"1": 0.01, "16": 0.02}}))
    monkeypatch.setattr(sys, "argv", ["prefix_sim", "--engines", "3", "--replicas", "2", "--tenants", "6",
                                      "--duration", "4", "--warmup", "1", "--loads", "0.3",
                                      "--calibration", str(path), "--out", str(tmp_path)])
    cli.main()
    report = json.loads((tmp_path / "prefix_sim.json").read_text())
    assert report["calibration"]["prefill_tokens_per_s"] == 3000
    runs = report["sweep"][0]["runs"]
    assert set(runs) == {*POLICIES, SGLANG}  # every kvfleet policy and the port of sglang-router's
    assert all(r["requests"] > 0 and r["ttft_p50_s"] is not None for r in runs.values())
    assert "| precise |" in (tmp_path / "prefix_sim.md").read_text()
    assert (tmp_path / "prefix_sim.png").stat().st_size > 0
    monkeypatch.setattr(sys, "argv", ["prefix_sim", "--calibration", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="prefix_sim: .*missing.json"):
        cli.main()


@pytest.mark.parametrize("policy", ["least-request", "precise", "prefix-affinity"])
def test_the_simulated_replicas_route_with_the_gateways_own_router(policy: str) -> None:
    """Every pick a simulated replica makes is the gateway's Router's (its rank, its dispatch bookkeeping), counted
    in its routing decisions: the simulator has no copy of the routing steps to drift from the gateway's."""
    result = run(policy)
    for replica in result.routers:
        assert isinstance(replica.router, Router)
        routed = sum(1 for job in result.jobs if job.meta.get("replica") is replica)
        decisions = sum(sample.value for family in replica.router.metrics.registry.collect()
                        for sample in family.samples if sample.name == "kvfleet_gateway_routing_decisions_total")
        assert routed > 0 and decisions >= routed
