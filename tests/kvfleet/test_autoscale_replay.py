"""`kvfleet bench autoscale`: a trace (a user's CSV or a bundled workload) replayed under every policy. Hostile
CSV gets a message naming the line and exit 2, the JSON has the documented shape, the oracle is the cheapest of
the policies that meet the SLOs, and a workload written to CSV replays to the same result."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.autoscale_replay.trace import Row, Trace, TraceError, parse_csv, read_csv, write_csv
from kvfleet.autoscale_replay.workloads import WORKLOADS, spike
from kvfleet.cli import main
from kvfleet.fleet.priority import Priority

GOOD = ("t,prompt_tokens,output_tokens,priority,tenant\n"
        "5.5,100,50,critical,a\n1,200,64,Standard,b\n3,50,20,sheddable,c\n")
CLASSES = ["critical", "standard", "sheddable"]


def replay(tmp_path: Path, *args: str) -> tuple[int, dict | None]:
    out = tmp_path / "out.json"
    code = main(["bench", "autoscale", *args, "--json", str(out)])
    return code, json.loads(out.read_text()) if code == 0 else None


def test_a_good_csv_is_read_sorted_with_extra_columns_ignored(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())  # a spreadsheet's UTF-8 byte-order mark
    trace = read_csv(path)
    assert [r.t for r in trace.rows] == [1.0, 3.0, 5.5]
    assert trace.rows[0] == Row(1.0, 200, 64, Priority.STANDARD)
    assert trace.duration_s == 6
    path.write_text(GOOD, encoding="utf-16")  # UTF-16 with its byte-order mark
    assert read_csv(path) == trace


@pytest.mark.parametrize("content,message", [
    (b"", "the file is empty; its first line must be the header t,prompt_tokens,output_tokens,priority"),
    (b"t,prompt_tokens,output_tokens\n1,2,3\n", "line 1: the header has no column priority"),
    (b"t,prompt_tokens,output_tokens,priority\n", "no requests after the header"),
    (b"t,prompt_tokens,output_tokens,priority\n1,10,10,critical\nsoon,10,10,standard\n",
     "line 3: t is 'soon'; write seconds from the trace's start"),
    (b"t,prompt_tokens,output_tokens,priority\n-1,10,10,critical\n", "line 2: t is '-1'"),
    (b"t,prompt_tokens,output_tokens,priority\nnan,10,10,critical\n", "line 2: t is 'nan'"),
    (b"t,prompt_tokens,output_tokens,priority\ninf,10,10,critical\n", "line 2: t is 'inf'"),
    (b"t,prompt_tokens,output_tokens,priority\n1,-5,10,critical\n",
     "line 2: prompt_tokens is '-5'; write a whole number from 1"),
    (b"t,prompt_tokens,output_tokens,priority\n1,5,1e3,critical\n", "line 2: output_tokens is '1e3'"),
    (b"t,prompt_tokens,output_tokens,priority\n1,5,5,urgent\n",
     "line 2: priority is 'urgent'; write one of critical, standard, sheddable"),
    (b"t,prompt_tokens,output_tokens,priority\n1,5,5\n", "line 2: no value for priority"),
    (b"t,prompt_tokens,output_tokens,priority\n1,5,5,critical\n2,5,5,caf\xe9\n", "line 3: not UTF-8 text"),
    (b"t,prompt_tokens,output_tokens,priority\n1,5,5,crit\x00ical\n", "line 2: priority is 'crit\\x00ical'"),
    (b"t,prompt_tokens,output_tokens,priority\n1,5,5," + b"x" * 200_000 + b"\n", "line 2: longer than"),
])
def test_hostile_csv_says_which_line_and_what_to_write_with_exit_2(tmp_path: Path, capsys, content: bytes,
                                                                     message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes(content)
    code, _ = replay(tmp_path, "--trace", str(path))
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"kvfleet bench autoscale: error: {path}") and message in err, err
    assert "Traceback" not in err


def test_the_installed_command_reports_a_bad_trace_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("t,prompt_tokens,output_tokens,priority\n1,5,5,urgent\n")
    out = subprocess.run([sys.executable, "-m", "kvfleet.cli", "bench", "autoscale", "--trace", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "line 2: priority is 'urgent'" in out.stderr and "Traceback" not in out.stderr
    missing = subprocess.run([sys.executable, "-m", "kvfleet.cli", "bench", "autoscale", "--trace",
                              str(tmp_path / "nope.csv")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "cannot read it" in missing.stderr


def test_a_gigantic_trace_is_streamed_and_refused_past_the_row_limit() -> None:
    class Endless(io.RawIOBase):
        """A header, then rows without end: reading must stop at the limit, not at the end of the file."""

        def __init__(self) -> None:
            self.data, self.rows = b"t,prompt_tokens,output_tokens,priority\n", 0

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            while len(self.data) < len(buffer):
                self.rows += 1
                self.data += f"{self.rows},100,64,standard\n".encode()
            buffer[:], self.data = self.data[:len(buffer)], self.data[len(buffer):]
            return len(buffer)

    with pytest.raises(TraceError, match="endless line 1002: more than 1,000 requests; replay a part of the trace"):
        parse_csv(Endless(), "endless", max_rows=1000)


def test_every_policy_runs_and_the_json_has_the_documented_shape(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    write_csv(spike(seed=1, duration_s=600, base_rps=1.0, factor=1.5, spike_s=60), path)  # light: some meet the SLOs
    code, results = replay(tmp_path, "--trace", str(path), "--cold-start", "20", "--attainment", "critical=0.98")
    assert code == 0 and list(results) == ["kvfleet", "keda-queue", "hpa-kv", "kpa", "oracle"]
    for result in results.values():
        assert set(result["slo_attainment"]) == set(result["shed"]) == set(CLASSES)
        assert all(0 <= v <= 1 for v in result["slo_attainment"].values())
        assert result["replica_seconds"] > 0 and all(isinstance(n, int) for n in result["shed"].values())
        assert result["settings"]["engine"]["cold_start_s"] == 20
        assert sum(result["requests"].values()) == sum(results["oracle"]["requests"].values())
    oracle = results["oracle"]
    targets = oracle["settings"]["attainment_target"]
    assert oracle["meets_targets"] and all(oracle["slo_attainment"][c] >= targets[c] for c in CLASSES)
    meeting = [name for name, r in results.items() if all(r["slo_attainment"][c] >= targets[c] for c in CLASSES)]
    assert len(meeting) > 1, results  # the comparison below is not empty
    assert all(oracle["replica_seconds"] <= results[name]["replica_seconds"] for name in meeting)
    assert oracle["work_bound_replica_seconds"] <= oracle["replica_seconds"]


def test_a_workload_round_trips_through_csv_to_the_same_result(tmp_path: Path) -> None:
    path = tmp_path / "spike.csv"
    write_csv(WORKLOADS["spike"](3), path)
    assert read_csv(path) == WORKLOADS["spike"](3)
    policies = ["--policy", "kvfleet", "--policy", "kpa"]
    _, direct = replay(tmp_path, "--workload", "spike", "--seed", "3", *policies)
    _, from_csv = replay(tmp_path, "--trace", str(path), *policies)
    for result in (*direct.values(), *from_csv.values()):
        result.pop("wall_s")
    assert direct == from_csv


def test_slo_flags_and_unknown_settings_are_checked(tmp_path: Path, capsys) -> None:
    code, _ = replay(tmp_path, "--workload", "spike", "--slo", "critical=fast")
    assert code == 2 and "--slo: 'critical=fast' is not CLASS=NUMBER" in capsys.readouterr().err
    code, _ = replay(tmp_path, "--workload", "spike", "--attainment", "standard=1.5")
    assert code == 2 and "attainment target of standard must be between 0 and 1" in capsys.readouterr().err
    code, _ = replay(tmp_path)
    assert code == 2 and "give --trace FILE (a CSV) or --workload NAME" in capsys.readouterr().err
    assert main(["bench", "autoscale", "--list-workloads"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in WORKLOADS)


def test_bundled_workloads_are_seeded_and_mix_the_classes() -> None:
    for name, make in WORKLOADS.items():
        trace: Trace = make(0)
        assert trace == make(0) and trace.rows != make(1).rows, name
        assert all(trace.count(p) > 0.05 * len(trace.rows) for p in Priority), name


def test_misses_no_policy_could_avoid_are_told_apart_and_the_oracle_plans_for_the_rest(tmp_path: Path) -> None:
    """A prompt whose prefill alone exceeds its class's objective misses under any schedule: the report gives each
    class's feasible share and the attainment among those, and the oracle meets its targets on them."""
    rows = [Row(t * 0.5, 600 if t % 10 == 0 else 100, 32, Priority.CRITICAL if t % 2 == 0 else Priority.STANDARD)
            for t in range(1200)]  # 600 tokens at 480 tokens/s: 1.25 s of prefill, over critical's 1 s
    path = tmp_path / "trace.csv"
    write_csv(Trace.of(rows), path)
    code, results = replay(tmp_path, "--trace", str(path), "--policy", "kvfleet", "--policy", "oracle")
    assert code == 0 and results is not None
    oracle, kvfleet = results["oracle"], results["kvfleet"]
    assert oracle["feasible"]["critical"] == pytest.approx(0.8)  # every fifth critical prompt is 600 tokens
    assert oracle["feasible"]["standard"] == 1.0
    assert oracle["slo_attainment"]["critical"] <= 0.8 + 1e-9  # the infeasible ones missed, whatever the pods
    assert oracle["meets_targets"] and oracle["feasible_attainment"]["critical"] >= 0.999
    for r in (oracle, kvfleet):
        assert r["feasible_attainment"]["critical"] >= r["slo_attainment"]["critical"]


def test_a_warm_pool_serves_a_scale_up_after_the_wake_not_the_cold_start_and_is_refilled() -> None:
    """A policy that asks for 4 pods at t=60: with a warm pool of 2, two of them serve 5 s later (they were asleep),
    the other two after the cold start; new pods keep the pool at 2 all along, counted apart as asleep."""
    from kvfleet.autoscale_replay.engine_model import EngineModel
    from kvfleet.autoscale_replay.fleet import simulate

    class Step:
        def __init__(self) -> None:
            self.seen: list[tuple[float, int, int, float | None]] = []

        def desired(self, view) -> int:  # noqa: ANN001 - a FleetView
            self.seen.append((view.time, len(view.pods), view.warm, view.wake_s))
            return 2 if view.time < 60 else 4

    engine = EngineModel(cold_start_s=30)
    served: dict[int, list[tuple[float, int]]] = {}
    for pool in (0, 2):
        policy = Step()
        run = simulate([], 150, policy, engine, initial_replicas=2, period_s=1, tail_s=0, warm_pool=pool, wake_s=5)
        served[pool] = [(t, ready) for t, ready, _, _ in policy.seen]
        assert run.asleep == [pool] * 150  # refilled as soon as woken: new pods load, then sleep
        assert run.pods[59] == 2 + pool and run.pods[61] == 4 + pool
        if pool:
            assert {(warm, wake) for t, _, warm, wake in policy.seen if t < 60} == {(2, 5.0)}
    assert dict(served[2])[64] == 2 and dict(served[2])[65] == 4 and dict(served[2])[90] == 4
    assert dict(served[0])[65] == 2 and dict(served[0])[90] == 4  # the cold start, 30 s


def test_a_critical_prompt_goes_to_the_busier_pod_rather_than_behind_a_long_standard_prefill() -> None:
    """Pod 0 decodes three short answers; pod 1 decodes one and prefills a 2,000-token standard prompt (4.2 s). A
    critical prompt of 0.9 s of prefill is in time only where no prompt is prefilling: pod 0, though it is the
    busier by requests (engines run critical prompts first, but not before the prefill in progress)."""
    from kvfleet.autoscale_replay.engine_model import EngineModel
    from kvfleet.autoscale_replay.fleet import simulate
    from kvfleet.autoscale_replay.replay import requests_of

    class Two:
        def desired(self, view) -> int:  # noqa: ANN001 - a FleetView
            return 2

    rows = [Row(0.1 * k, tokens, 256, Priority.STANDARD) for k, tokens in enumerate((10, 10, 10, 2000, 10))]
    rows.append(Row(1.5, 432, 8, Priority.CRITICAL))  # 432 tokens at 480 tokens/s: 0.9 s
    engine = EngineModel()
    requests = requests_of(Trace.of(rows), engine)
    simulate(requests, 10, Two(), engine, initial_replicas=2, period_s=1, tail_s=60)
    critical = requests[-1]
    assert critical.first_token is not None and critical.first_token - critical.arrival <= 1.0


def test_the_critical_lane_is_planned_for_and_reported(tmp_path: Path) -> None:
    plain = replay(tmp_path, "--workload", "spike", "--policy", "kvfleet")[1]["kvfleet"]
    lane = replay(tmp_path, "--workload", "spike", "--policy", "kvfleet", "--critical-lane")[1]["kvfleet"]
    assert lane["settings"]["kvfleet_critical_lane"] and not plain["settings"]["kvfleet_critical_lane"]
    # one pod more while critical requests come, which is all the trace long
    assert lane["replica_seconds"] - plain["replica_seconds"] >= 0.5 * spike(0).duration_s


def test_the_replay_reports_the_warm_pool_and_checks_its_flags(tmp_path: Path, capsys) -> None:
    code, report = replay(tmp_path, "--workload", "spike", "--policy", "kvfleet", "--warm-pool", "1",
                          "--wake-seconds", "4")
    assert code == 0 and report["kvfleet"]["settings"]["kvfleet_warm_pool"] == 1
    # one pod asleep (or loading to refill the pool) every second of the trace, however often the pool woke
    assert report["kvfleet"]["asleep_replica_seconds"] == spike(0).duration_s
    assert report["kvfleet"]["replica_seconds"] > spike(0).duration_s
    assert main(["bench", "autoscale", "--workload", "spike", "--warm-pool", "-1"]) == 2
    assert "--warm-pool must be from 0 to 100" in capsys.readouterr().err


def test_the_azure_conv_workload_follows_the_production_traces_published_statistics() -> None:
    """Its arrivals per minute keep the trace's swing (its quietest full minute to its busiest: 191 to 507), thinned
    to this fleet's scale; prompts keep its median (1,020 tokens x 0.12)."""
    import statistics

    from kvfleet.autoscale_replay.held_out import AZURE_RATE_SCALE, azure_conv, azure_conv_statistics

    stats = azure_conv_statistics()
    assert stats["rows"] == 19366 and len(stats["arrivals_per_step"]) == 350  # the shipped file is whole
    trace = azure_conv(101)
    per_minute = [0] * (trace.duration_s // 60)
    for r in trace.rows:
        if r.t < len(per_minute) * 60:
            per_minute[int(r.t // 60)] += 1
    assert 2.0 < max(per_minute) / min(per_minute) < 3.6
    assert abs(len(trace.rows) - stats["rows"] * AZURE_RATE_SCALE) < 0.05 * stats["rows"] * AZURE_RATE_SCALE
    assert 110 <= statistics.median(r.prompt_tokens for r in trace.rows) <= 135
    assert azure_conv(101) == trace and azure_conv(202) != trace
