"""`kvfleet bench autoscale --batch-jobs FILE`: Batch API jobs replayed beside the interactive trace, run by the
gateway runner's rule (only in the room interactive traffic leaves) and seen by the autoscaler as backlog with a
deadline. What a user reads: each job finished by its deadline or not, the interactive classes still within their
targets, replicas added only when a deadline is at risk, and a bad jobs file named by its line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.autoscale_replay.batch import BatchJob, BatchRunner, jobs_from_text
from kvfleet.autoscale_replay.engine_model import EngineModel, Pod, Request
from kvfleet.autoscale_replay.fleet import FleetView, simulate
from kvfleet.autoscale_replay.policies import KvfleetPolicy
from kvfleet.autoscale_replay.replay import Settings, replay, requests_of
from kvfleet.autoscale_replay.trace import Trace
from kvfleet.autoscale_replay.workloads import daily
from kvfleet.cli import main
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.config import DEFAULT_CAPS
from kvfleet.operator.autoscaler import AutoscalingPolicy

HEADER = "t,requests,prompt_tokens,output_tokens,window_s\n"


@pytest.fixture(scope="module")
def day() -> Trace:
    return daily(0)


def jobs(text: str) -> tuple[BatchJob, ...]:
    return jobs_from_text(HEADER + text)


def finished(result: dict) -> list[tuple[float | None, float, int]]:
    return [(j["finished_s"], j["deadline_s"], j["answered_on_time"]) for j in result["batch"]["jobs"]]


class BacklogBlind(KvfleetPolicy):
    """kvfleet's policy without the gateways' backlog reports: what the operator would do without batch demand."""

    def desired(self, view: FleetView) -> int:
        return super().desired(dataclasses.replace(view, batch=()))


def test_a_job_the_troughs_can_finish_adds_almost_no_replicas_and_keeps_interactive_targets(day: Trace) -> None:
    alone = replay(day, ["kvfleet"], Settings())["kvfleet"]
    beside = replay(day.with_jobs(jobs("0,5000,136,64,7200\n")), ["kvfleet"], Settings())["kvfleet"]
    (end, deadline, in_time), = finished(beside)
    assert in_time == 5000 and end is not None and end <= deadline
    assert beside["replica_seconds"] <= 1.1 * alone["replica_seconds"], (beside["replica_seconds"],
                                                                       alone["replica_seconds"])
    for c in ("critical", "standard"):
        assert beside["slo_attainment"][c] >= Settings().slo.attainment[Priority(c)], beside["slo_attainment"]
    assert beside["shed"]["critical"] == beside["shed"]["standard"] == 0


def test_a_job_at_risk_gets_pods_and_finishes_on_time_where_a_backlog_blind_policy_misses(day: Trace) -> None:
    trace = day.with_jobs(jobs("600,3000,136,64,1200\n4000,3000,136,64,1800\n"))
    result = replay(trace, ["kvfleet"], Settings())["kvfleet"]
    assert [in_time for *_, in_time in finished(result)] == [3000, 3000]
    assert all(end is not None and end <= deadline for end, deadline, _ in finished(result))
    assert result["slo_attainment"]["critical"] >= 0.999

    settings = Settings()
    blind = simulate(requests_of(trace, settings.engine), trace.duration_s,
                     BacklogBlind(AutoscalingPolicy(min_replicas=1, max_replicas=64)), settings.engine, 2, 15, 1800,
                     DEFAULT_CAPS, trace.jobs)
    assert blind.batch is not None
    assert blind.batch["answered_on_time"] < 0.9 * 6000, blind.batch  # the troughs alone do not finish them
    assert blind.batch["jobs_on_time"] == 0
    assert result["replica_seconds"] > sum(blind.pods)  # the deadlines cost pods, and only kvfleet pays them


def test_the_runner_sends_nothing_while_interactive_requests_wait_and_keeps_the_reserve() -> None:
    engine = EngineModel()
    runner = BatchRunner(jobs("0,1000,136,64,600\n"), engine)
    pod = Pod(engine, 0.0)
    load = pod.metrics(0.0)
    assert runner.dispatch(0.0, [(pod, load, 0, False)], interactive_queued=1) == {}
    assert runner.dispatch(0.0, [(pod, load, 0, True)], interactive_queued=0) == {}  # saturated
    sent = runner.dispatch(0.0, [(pod, load, 0, False)], interactive_queued=0)[0]
    assert len(sent) == 16  # the batch share: a quarter of 64 slots
    assert all(r.batch for r in sent)
    assert runner.dispatch(1.0, [(pod, load, 0, False)], interactive_queued=0) == {}  # its share is held
    assert runner.backlog(1.0)[0].remaining == 1000


def test_an_interactive_request_preempts_a_batch_request_in_a_full_pod() -> None:
    engine = EngineModel(max_num_seqs=2)
    pod = Pod(engine, 0.0)
    batch = [Request(1 << 40 | k, 0.0, 0.1, 10.0, batch=True) for k in range(2)]  # long answers: still running
    pod.advance(0.0, 1.0, [(0.0, r) for r in batch])
    critical = Request(1, 1.0, 0.1, 1.0, Priority.CRITICAL)
    pod.advance(1.0, 2.0, [(1.0, critical)])
    assert critical.first_token is not None and critical.first_token <= 1.2
    assert [r.batch for _, _, r in pod.waiting] == [True]


def test_a_job_whose_window_ends_expires_its_unsent_requests_and_says_so() -> None:
    engine = EngineModel()
    trace = Trace((), 0).with_jobs(jobs("0,100000,136,64,120\n"))
    assert trace.duration_s == 120
    run = simulate([], trace.duration_s, KvfleetPolicy(AutoscalingPolicy(min_replicas=1, max_replicas=2)), engine,
                   1, 15, 0, None, trace.jobs)
    assert run.batch is not None
    (job,) = run.batch["jobs"]
    assert not job["on_time"] and job["expired"] > 90_000
    assert job["answered_on_time"] + job["answered_late"] + job["expired"] <= 100_000


def test_the_command_reports_each_job_against_its_deadline(tmp_path: Path) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(HEADER + "300,400,100,32,900\n")
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "bench", "autoscale", "--workload", "spike",
                           "--batch-jobs", str(path), "--policy", "kvfleet", "--policy", "keda-queue",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "batch jobs" in done.stdout and "1/1 on time" in done.stdout
    result = json.loads(out.read_text())
    assert result["kvfleet"]["batch"]["jobs"][0]["deadline_s"] == 1200
    assert result["kvfleet"]["batch"]["requests"] == 400


@pytest.mark.parametrize(("content", "says"), [
    ("t,requests\n1,2\n", "no column prompt_tokens, output_tokens, window_s"),
    (HEADER, "no batch jobs"),
    (HEADER + "0,0,10,10,600\n", "line 2: requests is '0'"),
    (HEADER + "0,1e9,10,10,600\n", "line 2: requests is '1e9'"),
    (HEADER + "0,10,10,10,30\n", "at least 60 seconds"),
    (HEADER + "0,10,10,10,9e99\n", "window_s is '9e99'"),
    (HEADER + "600000,10,10,10,86400\n", "past the 604,800 s (a week) a replay covers"),
    (HEADER + "nan,10,10,10,600\n", "t is 'nan'"),
    (HEADER + "0,10,-4,10,600\n", "prompt_tokens is '-4'"),
    (HEADER + "0,10,10\n", "no value for output_tokens, window_s"),
])
def test_a_bad_jobs_file_names_the_line_and_exits_2(tmp_path: Path, capsys, content: str, says: str) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(content)
    code = main(["bench", "autoscale", "--workload", "spike", "--batch-jobs", str(path), "--policy", "kvfleet",
                 "--json", str(tmp_path / "o.json")])
    assert code == 2
    assert says in capsys.readouterr().err
