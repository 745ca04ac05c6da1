"""`kvfleet bench`: the seeded workload, the summary, and a run against a real engine process."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from kvfleet.bench_report import percentile, summarize
from kvfleet.cli import main
from kvfleet.loadgen import LoadSpec, RequestRecord, arrival_times, make_prompts, parse_priority_mix, plan_requests


def test_arrival_times_are_the_same_for_the_same_seed_and_differ_for_another() -> None:
    first = arrival_times(50, 10.0, random.Random(7))
    assert first == arrival_times(50, 10.0, random.Random(7))
    assert first != arrival_times(50, 10.0, random.Random(8))
    assert first[0] == 0.0 and first == sorted(first)


def test_mean_gap_is_one_over_the_rate() -> None:
    times = arrival_times(20_000, 25.0, random.Random(0))
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(1 / 25.0, rel=0.03)


@pytest.mark.parametrize("rate", [math.inf, 0.0])
def test_infinite_or_zero_rate_sends_everything_at_once(rate: float) -> None:
    assert arrival_times(5, rate, random.Random(0)) == [0.0] * 5


def test_priority_mix_is_normalized_in_class_order() -> None:
    assert parse_priority_mix("sheddable=3, critical=1") == {"critical": 0.25, "sheddable": 0.75}
    assert parse_priority_mix("critical=0.2,standard=0.5,sheddable=0.3") == pytest.approx(
        {"critical": 0.2, "standard": 0.5, "sheddable": 0.3})
    assert parse_priority_mix("Standard") == {"standard": 1.0}


@pytest.mark.parametrize("text, message", [
    ("urgent=1", "unknown priority class 'urgent' in the priority mix; use critical, standard, sheddable"),
    ("critical=lots", "cannot read 'lots' as a weight"),
    ("critical=-1", "must be a finite number >= 0"),
    ("critical=nan", "must be a finite number >= 0"),
    ("critical=0,standard=0", "all zero"),
    ("critical=1,critical=2", "appears twice"),
    ("", "the priority mix is empty"),
])
def test_bad_priority_mix_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_priority_mix(text)


@pytest.mark.parametrize("overrides, message", [
    ({"url": "localhost:8000"}, "--url must start with http:// or https://"),
    ({"num_requests": 0}, "--num-requests must be at least 1"),
    ({"rate": -1.0}, "--rate must be"),
    ({"rate": math.nan}, "--rate must be"),
    ({"shared_prefix": 1.5}, r"--shared-prefix is a fraction of the prompt in \[0, 1\]"),
    ({"endpoint": "embeddings"}, "--endpoint must be one of chat, completions"),
    ({"max_queue_ms": 0}, "--max-queue-ms must be a positive"),
    ({"priority_mix": {"vip": 1.0}}, "unknown priority class 'vip'"),
])
def test_load_spec_refuses_bad_settings(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadSpec(**({"url": "http://127.0.0.1:8000"} | overrides))


def test_plan_is_deterministic_and_shares_the_requested_prefix() -> None:
    spec = LoadSpec("http://h", num_requests=40, rate=5.0, prompt_words=20, shared_prefix=0.5,
                    priority_mix={"critical": 1, "sheddable": 1}, seed=3)
    plan = plan_requests(spec)
    assert plan == plan_requests(spec)
    assert {r.priority for r in plan} == {"critical", "sheddable"}
    words = [r.prompt.split() for r in plan]
    assert all(len(w) == 20 for w in words)
    assert all(w[:10] == words[0][:10] for w in words)
    assert len({tuple(w[10:]) for w in words}) == 40
    assert make_prompts(3, 8, 0.0, random.Random(1)) == make_prompts(3, 8, 0.0, random.Random(1))


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([], 50) is None


def test_summary_counts_statuses_and_uses_only_successes_for_latency() -> None:
    records = [
        RequestRecord(0, "critical", 0.0, 200, ttft_s=0.1, e2e_s=1.0, output_tokens=10, engine="http://e1"),
        RequestRecord(1, "critical", 0.5, 200, ttft_s=0.3, e2e_s=1.5, output_tokens=20, engine="http://e2"),
        RequestRecord(2, "sheddable", 1.0, 429, e2e_s=0.01, retry_after="1", error="shed"),
        RequestRecord(3, "sheddable", 1.0, None, e2e_s=3.0, error="timed out after 3 s"),
        RequestRecord(4, "standard", 1.0, 200, ttft_s=0.2, e2e_s=1.0, output_tokens=5, engine="http://e1"),
    ]
    summary = summarize(records)
    assert summary["duration_s"] == 4.0  # the timeout: sent at 1.0, gave up 3 s later
    overall = summary["overall"]
    assert (overall["count"], overall["ok"]) == (5, 3)
    assert overall["by_status"] == {"200": 3, "429": 1, "error": 1}
    assert overall["ttft_s"]["p50"] == 0.2 and overall["e2e_s"]["p50"] == 1.0
    assert overall["output_tokens_per_s"] == 35 / 4.0 and overall["requests_per_s"] == 5 / 4.0
    assert overall["engines"] == {"http://e1": 2, "http://e2": 1}
    assert list(summary["by_class"]) == ["critical", "standard", "sheddable"]
    assert summary["by_class"]["critical"]["ttft_s"]["p50"] == pytest.approx(0.2)
    assert summary["by_class"]["sheddable"]["ok"] == 0
    assert summary["by_class"]["sheddable"]["ttft_s"] == {"p50": None, "p90": None, "p99": None}


def test_bench_against_a_real_engine_writes_a_report_and_chart(tiny_server: str, tmp_path, capsys) -> None:
    code = main(["bench", "--url", tiny_server, "--num-requests", "12", "--rate", "50", "--priority-mix",
                 "critical=0.25,standard=0.5,sheddable=0.25", "--max-tokens", "8", "--prompt-words", "24",
                 "--shared-prefix", "0.5", "--out", str(tmp_path), "--quiet", "--seed", "1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    [report_path] = tmp_path.glob("bench-*.json")
    report = json.loads(report_path.read_text())
    records = report["records"]
    assert [r["index"] for r in records] == list(range(12))
    assert all(r["status"] == 200 and r["error"] is None for r in records), records
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in records)
    assert all(1 <= r["output_tokens"] <= 8 for r in records)
    summary = report["summary"]
    assert summary["overall"]["count"] == summary["overall"]["ok"] == 12
    assert summary["overall"]["by_status"] == {"200": 12}
    assert sum(c["count"] for c in summary["by_class"].values()) == 12
    for name, group in summary["by_class"].items():
        assert group["count"] == sum(r["priority"] == name for r in records)
    assert report["spec"]["model"] is None and "api_key" not in report["spec"]
    assert report_path.with_suffix(".png").stat().st_size > 10_000
    assert "all" in printed and f"wrote {report_path}" in printed

    report_path.with_suffix(".png").unlink()
    assert main(["bench", "--replot", str(report_path)]) == 0
    assert report_path.with_suffix(".png").exists()


def test_unreachable_url_exits_non_zero_with_one_clear_line(tmp_path) -> None:
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-m", "kvfleet.cli", "bench", "--url", url, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"kvfleet bench: cannot reach {url} (")
    assert line.endswith("); is the gateway or engine running there?")
    assert not list(tmp_path.iterdir())


def test_each_request_asks_for_one_of_the_models_uniformly_or_skewed() -> None:
    from kvfleet.loadgen import LoadSpec, plan_requests

    models = tuple(f"adapter-{i}" for i in range(8))
    uniform = plan_requests(LoadSpec(url="http://x", num_requests=4000, models=models))
    counts = {m: sum(r.model == m for r in uniform) for m in models}
    assert set(counts) == set(models) and min(counts.values()) > 400  # ~500 each
    skewed = plan_requests(LoadSpec(url="http://x", num_requests=4000, models=models, model_zipf=1.5))
    assert sum(r.model == "adapter-0" for r in skewed) > 5 * sum(r.model == "adapter-7" for r in skewed)
    assert all(r.model is None for r in plan_requests(LoadSpec(url="http://x", num_requests=10)))
