"""`kvfleet plan`: sizing from a request log (the CSV trace, or the engine's own request log, plain or JSON, written by
the real engine and formatter), the InferenceFleet it prints (accepted by the operator's spec parser), the post-mortem's
check (maxModelLen 8192 against ~1,000-token prompts: a warning with its cost in concurrency), and logs that cannot be
planned from answered with what to change."""

from __future__ import annotations

import csv
import json
import logging
import random
from pathlib import Path

import pytest
import yaml

from kvfleet.autoscale_replay.engine_model import EngineModel
from kvfleet.autoscale_replay.slo import Slo
from kvfleet.autoscale_replay.trace import Row, Trace, read_csv
from kvfleet.cli import PLAIN_LOG_FORMAT, main
from kvfleet.engine.request_log import JsonFormatter, log_finished
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.fleet.priority import Priority
from kvfleet.operator.fleet_spec import parse_fleet
from kvfleet.plan.sizing import (
    KV_WASTE_TARGET,
    LOAD_TEST_FACTOR,
    SIM_SECONDS,
    block_size_for,
    kv_waste,
    percentile,
    replicas_for,
    synthetic,
    with_batch,
)

CLASSES = ["critical", "standard", "sheddable"]


def write_trace(path: Path, rate: float = 3.0, seconds: int = 900, prompts: tuple[int, int] = (16, 256),
                seed: int = 1) -> Path:
    rng, t = random.Random(seed), 0.0
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "prompt_tokens", "output_tokens", "priority"])
        while (t := t + rng.expovariate(rate)) < seconds:
            w.writerow([round(t, 3), rng.randint(*prompts), rng.randint(8, 128), rng.choice(CLASSES)])
    return path


def plan(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    return code, capsys.readouterr().out


def printed_fleet(out: str) -> dict:
    return yaml.safe_load(out[out.index("apiVersion:"):])


def test_plan_from_a_trace_sizes_context_kv_and_replicas(tmp_path: Path, capsys) -> None:
    trace_path = write_trace(tmp_path / "trace.csv")
    code, out = plan(capsys, "--log", str(trace_path))
    assert code == 0, out
    rows = read_csv(trace_path).rows
    p99 = percentile([r.prompt_tokens for r in rows], 99) + percentile([r.output_tokens for r in rows], 99)
    fleet = printed_fleet(out)
    engine = fleet["spec"]["engine"]
    block = engine["blockSize"]
    assert engine["maxModelLen"] == -(-p99 // block) * block
    assert "maxModelLen" in out and "P99 prompt" in out and "150%" in out and f"blockSize {block}" in out
    parsed = parse_fleet("chat", "default", fleet["spec"])  # what the operator would run
    assert parsed.engine.max_model_len == engine["maxModelLen"] and parsed.replicas == fleet["spec"]["replicas"]


def test_the_block_size_is_the_largest_that_wastes_at_most_4_percent_of_the_kv_cache() -> None:
    assert kv_waste([17, 32], 16) == 15 / 64  # the first sequence's second block holds one token of 16
    def trace(context: int) -> Trace:
        return Trace.of(Row(float(i), context, 2, Priority.STANDARD) for i in range(20))
    assert block_size_for(trace(1000 - 1))[0] == 32  # 1,000 tokens: a 32-token block wastes under 4 %
    size, waste = block_size_for(trace(135 - 1))  # the engine benchmark's contexts at its peak
    assert size == 8 and waste <= KV_WASTE_TARGET
    assert block_size_for(trace(20 - 1)) == (8, kv_waste([20], 8))  # nothing reaches it: the smallest, said


def test_the_replicas_are_the_fewest_that_meet_the_slo(tmp_path: Path) -> None:
    engine, slo = with_batch(EngineModel(), 64), Slo()
    load = synthetic(read_csv(write_trace(tmp_path / "trace.csv")), 3.0 * LOAD_TEST_FACTOR, SIM_SECONDS)
    n, met = replicas_for(load, engine, slo, 64)
    assert n is not None and n > 1 and slo.met(met)
    assert replicas_for(load, engine, slo, n - 1)[0] is None  # one pod fewer misses a target


def test_max_tokens_sets_the_output_allowance(tmp_path: Path, capsys) -> None:
    trace_path = write_trace(tmp_path / "trace.csv")
    rows = read_csv(trace_path).rows
    code, out = plan(capsys, "--log", str(trace_path), "--max-tokens", "1000")
    assert code == 0
    expected = percentile([r.prompt_tokens for r in rows], 99) + 1000
    engine = printed_fleet(out)["spec"]["engine"]
    assert engine["maxModelLen"] == -(-expected // engine["blockSize"]) * engine["blockSize"]


def test_the_post_mortem_fleet_is_warned_with_its_cost(tmp_path: Path, capsys) -> None:
    """maxModelLen 8192 'to be safe' while prompts average ~1,000 tokens (the vLLM OOM post-mortem)."""
    trace_path = write_trace(tmp_path / "trace.csv", rate=0.5, prompts=(600, 1400))
    fleet = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": "chat"},
             "spec": {"model": "smollm2-135m-instruct",
                      "engine": {"maxModelLen": 8192, "maxNumSeqs": 16, "kvCacheMemory": "1Gi"}}}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    code, out = plan(capsys, "--log", str(trace_path), "--check", str(tmp_path / "fleet.yaml"))
    assert code == 1
    warning = next(line for line in out.splitlines() if line.startswith("WARNING: maxModelLen 8,192"))
    assert "requests can run to maxModelLen at once" in warning and "Set maxModelLen: 1" in warning
    _, recommended = plan(capsys, "--log", str(trace_path), "--slo", "critical=10,standard=10")
    (tmp_path / "planned.yaml").write_text(recommended[recommended.index("apiVersion:"):])
    code, out = plan(capsys, "--log", str(trace_path), "--check", str(tmp_path / "planned.yaml"))
    assert code == 0 and "fits" in out


def engine_log(tiny_engine, path: Path, formatter: logging.Formatter, n: int = 6) -> list:
    outputs = tiny_engine.generate([f"request {i} " * (i + 1) for i in range(n)],
                                   SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    handler = logging.FileHandler(path)
    handler.setFormatter(formatter)
    logger = logging.getLogger("kvfleet.requests")
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.INFO
    try:
        logging.getLogger("kvfleet").info("an unrelated line the reader skips")
        for out in outputs:
            log_finished(out)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        handler.close()
    return outputs


@pytest.mark.parametrize("formatter", [JsonFormatter(), logging.Formatter(PLAIN_LOG_FORMAT)],
                         ids=["json", "plain"])
def test_plan_reads_the_engines_request_log(tiny_engine, tmp_path: Path, capsys, formatter) -> None:
    outputs = engine_log(tiny_engine, tmp_path / "engine.log", formatter)
    code, out = plan(capsys, "--log", str(tmp_path / "engine.log"))
    assert code == 0, out
    assert f"The log holds {len(outputs)} requests" in out
    longest = max(len(o.prompt_token_ids) for o in outputs)
    engine = printed_fleet(out)["spec"]["engine"]
    assert engine["maxModelLen"] == -(-(longest + 5) // engine["blockSize"]) * engine["blockSize"]


@pytest.mark.parametrize(("content", "says"), [
    (b"", "the file is empty"),
    (b"\x00\x01\x02 not a log", "header"),
    (b'{"time": "2026-11-26T10:00:00Z", "level": "INFO", "message": "hello"}\n', "no finished requests"),
    (b"t,prompt_tokens,output_tokens,priority\n1,12,8,urgent\n", "priority"),
    (b"{" + b"x" * 70_000 + b"\n", "longer than"),
])
def test_logs_that_cannot_be_planned_from_say_what_to_give(tmp_path: Path, capsys, content: bytes,
                                                           says: str) -> None:
    (tmp_path / "bad.log").write_bytes(content)
    assert main(["plan", "--log", str(tmp_path / "bad.log")]) == 2
    assert says in capsys.readouterr().err


def test_an_slo_no_replica_count_meets_is_said_so(tmp_path: Path, capsys) -> None:
    trace_path = write_trace(tmp_path / "trace.csv", prompts=(1500, 3000))
    code, out = plan(capsys, "--log", str(trace_path))
    assert code == 1 and "No number of replicas meets critical's 1 s" in out
    assert json.dumps(printed_fleet(out))  # still a fleet to start from


@pytest.mark.parametrize(("engine", "says"), [
    ([1, 2], "spec.engine must be an object"),
    ({"maxModelLen": "abc"}, "spec.engine.maxModelLen must be an integer"),
    ({"kvCacheMemory": "lots"}, "spec.engine.kvCacheMemory"),
])
def test_a_fleet_the_operator_would_refuse_is_refused_naming_the_field(tmp_path: Path, capsys, engine,
                                                                        says: str) -> None:
    fleet = {"kind": "InferenceFleet", "spec": {"model": "smollm2-135m-instruct", "engine": engine}}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    code = main(["plan", "--log", str(write_trace(tmp_path / "t.csv")), "--check", str(tmp_path / "fleet.yaml")])
    assert code == 2 and says in capsys.readouterr().err


def test_a_fleet_that_leaves_fields_out_is_checked_with_the_operators_defaults(tmp_path: Path, capsys) -> None:
    """No maxModelLen: the operator runs the fleet's default (2,048), which is what is weighed against the traffic."""
    fleet = {"kind": "InferenceFleet", "spec": {"model": "smollm2-135m-instruct"}}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    code, out = plan(capsys, "--log", str(write_trace(tmp_path / "t.csv", prompts=(16, 200))),
                     "--check", str(tmp_path / "fleet.yaml"))
    assert code == 1 and "WARNING: maxModelLen 2,048 is" in out


def test_rates_and_batches_no_fleet_could_serve_are_answered_without_replaying(tmp_path: Path, capsys) -> None:
    trace = str(write_trace(tmp_path / "t.csv"))
    code, out = plan(capsys, "--log", trace, "--qps", "1e9")
    assert code == 1 and "more than 64 pods" in out
    assert main(["plan", "--log", trace, "--max-num-seqs", "100000000"]) == 2
    assert "--max-num-seqs must be at most 4096" in capsys.readouterr().err
