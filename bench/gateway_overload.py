"""Overload: twice the fleet's capacity with a priority mix; does every request get an answer, and does
critical traffic keep its latency?

    python -m bench.gateway_overload --duration 60 --out bench/results
    python -m bench.gateway_overload --quick          # a ~1-minute smoke run; its figures are noise
    python -m bench.gateway_overload --duration 60 --ladder standard=32 --fallback-model tiny   # the whole ladder

Two engines of the tiny random Llama (--max-num-seqs 4 each, one torch thread) behind one kvfleet gateway with
its Redis queue. Capacity is measured first (every engine kept full, completions per second for chat,
32-word prompts, 128 tokens, EOS ignored). Then: an unloaded baseline, critical requests alone at the rate
critical gets in the overload run (0.4× capacity, nothing else queued), and the overload run: Poisson at
2× capacity, critical 0.2, standard 0.5, sheddable 0.3. Reports per class the answers (200 / 429 shed / 503 queue
deadline), TTFT p50/p99, each class's mean wait in the gateway's queue, the CPU each process used, and critical
p99 TTFT under overload ÷ unloaded. Exits 1 if any request got no answer (timeout, connection error,
broken stream).

The degradation ladder, side by side in the same run: --ladder runs the overload again through a gateway that caps
the output of the classes named while the fleet is saturated (its first rung); --fallback-model M starts one more
engine of model M (idle until then) and runs the overload a last time through a gateway serving both models, the
bench model's requests (all sent with x-kvfleet-allow-fallback: true) falling back to M while the main fleet is
saturated and M's has room (the second rung), with the caps of --ladder if given. Shedding is the last rung in
every arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.capacity import saturated_throughput
from bench.fleet_procs import MODEL_NAME, BenchFleet, cpu_used, gateway_queue_waits, get, queue_waits_between
from bench.loop_lag import describe_lag, with_loop_lag
from bench.plotting import finish, pyplot
from kvfleet.bench_report import CLASS_COLORS, REJECTION_MARKERS, summarize
from kvfleet.loadgen import LoadSpec, RequestRecord, parse_priority_mix, run_load


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random 3-layer Llama) or a model for the engines")
    parser.add_argument("--engines", default="4,4", help="--max-num-seqs of each engine")
    parser.add_argument("--overload", type=float, default=2.0, help="arrival rate as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals in the overload run")
    parser.add_argument("--baseline-duration", type=float, default=20.0, help="seconds of the critical-only run")
    parser.add_argument("--mix", default="critical=0.2,standard=0.5,sheddable=0.3")
    parser.add_argument("--max-queue-ms", type=int, default=10_000, help="the gateway's queue deadline")
    parser.add_argument("--calibrate-s", type=float, default=10.0, help="seconds of the capacity measurement")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request; long enough that the gateway's per-request work stays small "
                             "beside the engines' on this machine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ladder", default="", metavar="CLASS=N,...",
                        help="also run the overload again through a fresh gateway with the degradation ladder's "
                             "first rung (--degrade-max-tokens CLASS=N,...), side by side with the run without it")
    parser.add_argument("--fallback-model", default=None, metavar="MODEL",
                        help="also run the overload through a gateway whose requests may fall back to one engine of "
                             "MODEL ('tiny' or what `kvfleet engine --model` takes), with --ladder's caps")
    parser.add_argument("--quick", action="store_true", help="short runs and a 3 s queue deadline, to check it works")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.baseline_duration, args.calibrate_s, args.max_queue_ms = 12.0, 5.0, 4.0, 3_000
    return args


def answered(r: RequestRecord | dict) -> bool:
    """An HTTP answer came back and, for a 200, its stream ran to data: [DONE] without an error event."""
    status, error = (r.status, r.error) if isinstance(r, RequestRecord) else (r["status"], r["error"])
    return status is not None and (status != 200 or error is None)


def main() -> int:
    args = parse_args()
    if args.replot:
        chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    seqs = [int(s) for s in args.engines.split(",")]
    mix = parse_priority_mix(args.mix)
    base = LoadSpec(url="http://placeholder", prompt_words=args.prompt_words, max_tokens=args.max_tokens,
                    ignore_eos=True, model=MODEL_NAME, seed=args.seed)
    started = time.monotonic()
    with BenchFleet(args.model, seqs) as fleet:
        capacity = asyncio.run(saturated_throughput({e.url: s for e, s in zip(fleet.engines, seqs, strict=True)},
                                                    base, MODEL_NAME, args.calibrate_s))["requests_per_s"]
        rate = args.overload * capacity
        critical_rate = rate * mix.get("critical", 0.0)
        print(f"capacity: {capacity:.2f} req/s; overload {rate:.2f} req/s for {args.duration:g} s; "
              f"baseline: critical alone at {critical_rate:.2f} req/s", flush=True)
        url = fleet.start_gateway("kvfleet", fleet="overload", extra=["--max-queue-ms", str(args.max_queue_ms)])
        baseline = LoadSpec(url=url, num_requests=max(1, round(critical_rate * args.baseline_duration)),
                            rate=critical_rate, priority_mix={"critical": 1.0}, prompt_words=args.prompt_words,
                            max_tokens=args.max_tokens, ignore_eos=True, model=MODEL_NAME, seed=args.seed + 1)
        baseline_records, baseline_lag = asyncio.run(with_loop_lag(run_load(baseline, progress=False)))
        fleet.wait_idle()
        overload = LoadSpec(url=url, num_requests=max(1, round(rate * args.duration)), rate=rate, priority_mix=mix,
                            prompt_words=args.prompt_words, max_tokens=args.max_tokens, ignore_eos=True,
                            model=MODEL_NAME, seed=args.seed)
        cpu_before, waits_before, run_started = fleet.cpu_snapshot(), gateway_queue_waits(url), time.monotonic()
        records, lag = asyncio.run(with_loop_lag(run_load(overload, progress=False)))
        run_wall = time.monotonic() - run_started
        cpu = cpu_used(cpu_before, fleet.cpu_snapshot())
        queue_waits = queue_waits_between(waits_before, gateway_queue_waits(url))
        ladder, fallback, records_all = None, None, list(records)
        if args.ladder:
            fleet.wait_idle()
            ladder_url = fleet.start_gateway("kvfleet", fleet="overload-ladder", extra=[
                "--max-queue-ms", str(args.max_queue_ms), "--degrade-max-tokens", args.ladder])
            ladder_records, _ = asyncio.run(with_loop_lag(run_load(replace(overload, url=ladder_url), progress=False)))
            records_all += ladder_records
            ladder = {"degrade_max_tokens": args.ladder, "summary": summarize(ladder_records),
                      "degraded": gateway_degraded(ladder_url), "records": [asdict(r) for r in ladder_records]}
        if args.fallback_model:
            fleet.start_fallback(args.fallback_model, seqs[0])
            fleet.wait_idle()
            caps = ["--degrade-max-tokens", args.ladder] if args.ladder else []
            fallback_url = fleet.start_gateway("kvfleet", extra=["--max-queue-ms", str(args.max_queue_ms), *caps],
                                               with_fallback=True)
            fallback_records, _ = asyncio.run(with_loop_lag(run_load(
                replace(overload, url=fallback_url, allow_fallback=True), progress=False)))
            records_all += fallback_records
            fallback_urls = {e.url for e in fleet.fallback_engines}
            fallback = {"model": args.fallback_model, "degrade_max_tokens": args.ladder or None,
                        "summary": summarize(fallback_records), "degraded": gateway_degraded(fallback_url),
                        "served_by_fallback": _by_class(r for r in fallback_records if r.engine in fallback_urls),
                        "records": [asdict(r) for r in fallback_records]}
    unanswered = [r for r in records_all + baseline_records if not answered(r)]
    summary, baseline_summary = summarize(records), summarize(baseline_records)
    critical_p99 = summary["by_class"].get("critical", {}).get("ttft_s", {}).get("p99")
    unloaded_p99 = baseline_summary["overall"]["ttft_s"]["p99"]
    report = {
        "command": shlex.join(["python", "-m", "bench.gateway_overload", *sys.argv[1:]]),
        "engines_max_num_seqs": seqs, "capacity_requests_per_s": capacity, "rate": rate,
        "max_queue_ms": args.max_queue_ms, "wall_s": time.monotonic() - started,
        "client_loop_lag_s": max(lag, baseline_lag),
        "overload_cpu_cores": {name: seconds / run_wall for name, seconds in cpu.items()},
        "gateway_queue_waits": queue_waits,
        "all_answered": not unanswered, "unanswered": [asdict(r) for r in unanswered],
        "critical_p99_ttft_overload_s": critical_p99, "critical_p99_ttft_unloaded_s": unloaded_p99,
        "critical_p99_ratio": critical_p99 / unloaded_p99 if critical_p99 and unloaded_p99 else None,
        "overload": {"spec": overload.public(), "summary": summary, "records": [asdict(r) for r in records]},
        "baseline": {"spec": baseline.public(), "summary": baseline_summary,
                     "records": [asdict(r) for r in baseline_records]},
        "ladder": ladder,
        "fallback": fallback,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gateway_overload.json"
    path.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(ladder_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")
    return 0 if not unanswered else 1


def gateway_degraded(gateway_url: str) -> dict[str, dict[str, float]]:
    """From the gateway's /metrics: answers served degraded, per class and step (summed over models)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(get(gateway_url + "/metrics") or "")
    out: dict[str, dict[str, float]] = {}
    for family in families:
        for s in family.samples:
            if s.name == "kvfleet_gateway_degraded_total":
                steps = out.setdefault(s.labels["priority"], {})
                steps[s.labels["step"]] = steps.get(s.labels["step"], 0.0) + s.value
    return out


def _by_class(records) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.priority] = counts.get(r.priority, 0) + 1
    return counts


def ladder_table(report: dict) -> str:
    """Per class and arm (without the ladder, with its caps, with its caps and fallback): answered 200 / 429 / 503,
    TTFT p50 / p99, answers capped, answers from the fallback model."""
    ladder, fallback = report.get("ladder"), report.get("fallback")
    if not ladder and not fallback:
        return ""
    arms = [("without", report["overload"]["summary"], {}, {})]
    if ladder:
        arms.append(("cap", ladder["summary"], ladder["degraded"], {}))
    if fallback:
        arms.append(("cap+fallback" if fallback["degrade_max_tokens"] else "fallback", fallback["summary"],
                     fallback["degraded"], fallback["served_by_fallback"]))
    caps = (ladder or fallback)["degrade_max_tokens"]
    rows = [f"\nthe same overload through gateways with the degradation ladder (caps: {caps or 'none'}"
            f"{', fallback: one engine of ' + fallback['model'] if fallback else ''}):",
            f"{'class':<10} {'arm':<13} {'200':>5} {'429':>5} {'503':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'capped':>7} {'fell back':>9}"]
    for name in report["overload"]["summary"]["by_class"]:
        for arm, summary, degraded, fell_back in arms:
            g = summary["by_class"].get(name)
            if g is None:
                continue
            by = g["by_status"]
            capped = degraded.get(name, {}).get("max_tokens", 0.0) if arm != "without" else None
            rows.append(f"{name:<10} {arm:<13} {by.get('200', 0):>5} {by.get('429', 0):>5} {by.get('503', 0):>5} "
                        f"{_s(g['ttft_s']['p50']):>9} {_s(g['ttft_s']['p99']):>9} "
                        f"{'-' if capped is None else int(capped):>7} "
                        f"{fell_back.get(name, 0) if arm.endswith('fallback') else '-':>9}")
    return "\n".join(rows)


def format_table(report: dict) -> str:
    rows = [f"{'class':<18} {'count':>5} {'answered':>8}  {'200':>5} {'429':>5} {'503':>5} {'other':>5}  "
            f"{'TTFT p50':>9} {'TTFT p99':>9}"]
    groups = [*report["overload"]["summary"]["by_class"].items(),
              ("critical unloaded", report["baseline"]["summary"]["overall"])]
    records = {"critical unloaded": report["baseline"]["records"]}
    for name, g in groups:
        mine = records.get(name) or [r for r in report["overload"]["records"] if r["priority"] == name]
        by = g["by_status"]
        other = g["count"] - sum(by.get(code, 0) for code in ("200", "429", "503"))
        rows.append(f"{name:<18} {g['count']:>5} {sum(answered(r) for r in mine):>8}  {by.get('200', 0):>5} "
                    f"{by.get('429', 0):>5} {by.get('503', 0):>5} {other:>5}  {_s(g['ttft_s']['p50']):>9} "
                    f"{_s(g['ttft_s']['p99']):>9}")
    n_unanswered = len(report["unanswered"])
    cpu = report["overload_cpu_cores"]
    ratio = report["critical_p99_ratio"]
    return "\n".join([
        f"\n{report['command']}",
        f"fleet capacity {report['capacity_requests_per_s']:.2f} req/s; overload {report['rate']:.2f} req/s "
        f"({report['overload']['spec']['num_requests']} requests); gateway queue deadline {report['max_queue_ms']} ms",
        *rows,
        "every request got an answer" if not n_unanswered else
        f"FAILED: {n_unanswered} request(s) got no answer, e.g. {report['unanswered'][0]['error']}",
        f"critical p99 TTFT: {_s(report['critical_p99_ttft_overload_s'])} under overload vs "
        f"{_s(report['critical_p99_ttft_unloaded_s'])} unloaded ({'-' if ratio is None else f'{ratio:.2f}'}×)",
        "mean wait in the gateway's queue (the rest of TTFT is the engine's queue and prefill): " + ", ".join(
            f"{p} {_s(w['mean_wait_s'])} ({w['queued']} queued)" for p, w in report["gateway_queue_waits"].items()),
        "CPU during the overload run (cores): " + ", ".join(
            f"{name} {cores:.2f}" for name, cores in sorted(cpu.items(), key=lambda kv: -kv[1])),
        describe_lag(report["client_loop_lag_s"]),
    ])


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def chart(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (timeline, cdf) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    records = report["overload"]["records"]
    for name, color in CLASS_COLORS.items():
        mine = [r for r in records if r["priority"] == name]
        ok = [r for r in mine if r["status"] == 200 and r["error"] is None and r["ttft_s"] is not None]
        timeline.scatter([r["sent_at"] for r in ok], [r["ttft_s"] for r in ok], s=8, color=color, label=f"{name} TTFT")
        for status, (marker, label) in REJECTION_MARKERS.items():
            hit = [r for r in mine if r["status"] == status]
            if hit:
                timeline.scatter([r["sent_at"] for r in hit], [r["e2e_s"] for r in hit], marker=marker, s=22,
                                 color=color, label=f"{name} {label} (time to answer)")
        values = sorted(r["ttft_s"] for r in ok)
        if values:
            cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=color,
                     label=f"{name}, overload")
    unloaded = sorted(r["ttft_s"] for r in report["baseline"]["records"] if r["ttft_s"] is not None)
    if unloaded:
        cdf.step(unloaded, [(i + 1) / len(unloaded) for i in range(len(unloaded))], "--", where="post",
                 color=CLASS_COLORS["critical"], label="critical, unloaded")
    lost = [r for r in records if not answered(r)]
    if lost:
        timeline.scatter([r["sent_at"] for r in lost], [r["e2e_s"] for r in lost], marker="*", s=40, color="black",
                         label="no answer")
    timeline.set(yscale="log", xlabel="sent at (s from start)", ylabel="TTFT, or time to a 429/503 (s, log)",
                 title=f"overload at {report['rate']:.1f} req/s "
                       f"({report['rate'] / report['capacity_requests_per_s']:.1f}× capacity)")
    cdf.set(xscale="log", xlabel="TTFT (s, log)", ylabel="fraction of the class's 200 answers",
            title="TTFT CDF by class")
    return finish(fig, path, (timeline, cdf), legend_fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
