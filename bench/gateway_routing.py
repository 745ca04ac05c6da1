"""Routing quality: round-robin vs least-request vs kvfleet in front of engines of unequal capacity.

    python -m bench.gateway_routing --duration 60 --out bench/results
    python -m bench.gateway_routing --quick          # a ~1-minute smoke run; its figures are noise

Four engines of the tiny random Llama with --max-num-seqs 1, 2, 4 and 8 (one torch thread each). Their
capacity is measured first, without a gateway: every engine kept full at once, completions per second for the
request shape (chat, 32-word prompts, 32 output tokens, EOS ignored). Then the same seeded Poisson workload at
80 % of that capacity goes through a fresh gateway (Redis queue) per strategy, the engines idle in between.
Reports TTFT and end-to-end p50/p99 per strategy, each engine's share of the requests, the CPU each part used
(the gateway's share comes out of the engines', so the real load is somewhat above 80 %), and kvfleet p99 TTFT ÷
round-robin's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.capacity import saturated_throughput
from bench.fleet_procs import MODEL_NAME, BenchFleet, cpu_used
from bench.loop_lag import describe_lag, with_loop_lag
from bench.plotting import finish, pyplot
from kvfleet.bench_report import summarize
from kvfleet.gateway.routing.strategies import STRATEGIES
from kvfleet.loadgen import LoadSpec, run_load

DEFAULT_STRATEGIES = ("round-robin", "least-request", "kvfleet")
COLORS = {"round-robin": "tab:gray", "least-request": "tab:blue", "kvfleet": "tab:green",
          "estimated-ttft": "tab:orange", "prefix-affinity": "tab:purple"}
TARGET_P99_RATIO = 0.6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random 3-layer Llama) or a model for the engines")
    parser.add_argument("--engines", default="1,2,4,8", help="--max-num-seqs of each engine")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of measured capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per strategy")
    parser.add_argument("--calibrate-s", type=float, default=15.0, help="seconds of the capacity measurement")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help=f"comma-separated, of {', '.join(STRATEGIES)} (round-robin is always run: the reference)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short calibration and runs, to check it works")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.calibrate_s = 5.0, 4.0
    args.strategies = ["round-robin", *(n for n in args.strategies.split(",") if n and n != "round-robin")]
    unknown = [n for n in args.strategies if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {', '.join(unknown)}; known: {', '.join(STRATEGIES)}")
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    seqs = [int(s) for s in args.engines.split(",")]
    shape = LoadSpec(url="http://placeholder", prompt_words=args.prompt_words, max_tokens=args.max_tokens,
                     ignore_eos=True, model=MODEL_NAME, seed=args.seed)
    started = time.monotonic()
    with BenchFleet(args.model, seqs) as fleet:
        names = {e.url: e.name for e in fleet.engines}
        capacity = asyncio.run(saturated_throughput({e.url: s for e, s in zip(fleet.engines, seqs, strict=True)},
                                                    shape, MODEL_NAME, args.calibrate_s))
        rate = args.load * capacity["requests_per_s"]
        print(f"capacity: {capacity['requests_per_s']:.2f} req/s ("
              + ", ".join(f"{names[u]} {r:.2f}" for u, r in capacity["by_engine"].items())
              + f"); sending {args.load:.0%} of it: {rate:.2f} req/s for {args.duration:g} s", flush=True)
        spec = LoadSpec(url="http://placeholder", num_requests=max(1, round(rate * args.duration)), rate=rate,
                        prompt_words=args.prompt_words, max_tokens=args.max_tokens, ignore_eos=True,
                        model=MODEL_NAME, seed=args.seed)
        runs = {}
        for strategy in args.strategies:
            fleet.wait_idle()
            spec.url = fleet.start_gateway(strategy, fleet=f"routing-{strategy}")
            cpu_before, run_started = fleet.cpu_snapshot(), time.monotonic()
            records, lag = asyncio.run(with_loop_lag(run_load(spec, progress=False)))
            used, wall = cpu_used(cpu_before, fleet.cpu_snapshot()), time.monotonic() - run_started
            cores = {name: seconds / wall for name, seconds in used.items()}
            summary = summarize(records)
            summary["overall"]["engines"] = {names.get(u, u): n for u, n in summary["overall"]["engines"].items()}
            runs[strategy] = {"summary": summary["overall"], "duration_s": summary["duration_s"],
                              "client_loop_lag_s": lag, "cpu_cores": cores, "records": [asdict(r) for r in records]}
            print(f"{strategy}: done in {summary['duration_s']:.1f} s", flush=True)
        fleet.stop_gateway()
    report = {
        "command": shlex.join(["python", "-m", "bench.gateway_routing", *sys.argv[1:]]),
        "engines": {names[u]: {"max_num_seqs": s, "capacity_requests_per_s": capacity["by_engine"][u]}
                    for u, s in zip(names, seqs, strict=True)},
        "capacity_requests_per_s": capacity["requests_per_s"], "load": args.load, "rate": rate,
        "spec": spec.public() | {"url": "gateway"}, "wall_s": time.monotonic() - started,
        **{f"p99_ttft_ratio_{name.replace('-', '_')}_to_round_robin": _ratio(runs, name) for name in runs
           if name != "round-robin"},
        "target_p99_ttft_ratio": TARGET_P99_RATIO, "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gateway_routing.json"
    path.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")


def _ratio(runs: dict, strategy: str) -> float | None:
    ours, base = runs[strategy]["summary"]["ttft_s"]["p99"], runs["round-robin"]["summary"]["ttft_s"]["p99"]
    return ours / base if ours is not None and base else None


def format_table(report: dict) -> str:
    engines = list(report["engines"])
    rows = [f"{'strategy':<14} {'ok/sent':>9}  {'TTFT p50':>9} {'TTFT p99':>9}  {'e2e p50':>8} {'e2e p99':>8}  "
            f"requests per engine ({', '.join(engines)})"]
    for strategy, run in report["runs"].items():
        s = run["summary"]
        share = " / ".join(str(s["engines"].get(e, 0)) for e in engines)
        rows.append(f"{strategy:<14} {s['ok']:>4}/{s['count']:<4}  {_s(s['ttft_s']['p50']):>9} "
                    f"{_s(s['ttft_s']['p99']):>9}  {_s(s['e2e_s']['p50']):>8} {_s(s['e2e_s']['p99']):>8}  {share}")
    capacity = " / ".join(f"{v['capacity_requests_per_s']:.2f}" for v in report["engines"].values())
    ratios = {name: report.get(f"p99_ttft_ratio_{name.replace('-', '_')}_to_round_robin") for name in report["runs"]
              if name != "round-robin"}
    target = report["target_p99_ttft_ratio"]
    return "\n".join([
        f"\n{report['command']}",
        f"fleet capacity {report['capacity_requests_per_s']:.2f} req/s (per engine {capacity}); "
        f"load {report['rate']:.2f} req/s ({report['load']:.0%}), Poisson, seed {report['spec']['seed']}",
        *rows,
        "p99 TTFT / round-robin's (target <= " + f"{target}): " + "; ".join(
            f"{name} {_x(r)} ({'-' if r is None else 'met' if r <= target else 'NOT met'})"
            for name, r in ratios.items()),
        "CPU during each run (cores; capacity was measured without a gateway): " + "; ".join(
            f"{strategy} {_cpu_split(run['cpu_cores'])}" for strategy, run in report["runs"].items()),
        describe_lag(max(run["client_loop_lag_s"] for run in report["runs"].values())),
    ])


def _cpu_split(cores: dict[str, float]) -> str:
    engines = sum(v for k, v in cores.items() if k.startswith("engine"))
    gateway = sum(v for k, v in cores.items() if k.startswith("gateway"))
    return f"engines {engines:.2f}, gateway {gateway:.2f}, client {cores['client']:.2f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def chart(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(13, 5))
    labels, groups = list(report["runs"]), ("TTFT p50", "TTFT p99", "e2e p50", "e2e p99")
    width = 0.8 / len(labels)
    for i, (strategy, run) in enumerate(report["runs"].items()):
        ttfts = sorted(r["ttft_s"] for r in run["records"] if r["status"] == 200 and r["ttft_s"] is not None)
        if ttfts:
            cdf.step(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], where="post",
                     color=COLORS.get(strategy), label=strategy)
        s = run["summary"]
        values = [s["ttft_s"]["p50"], s["ttft_s"]["p99"], s["e2e_s"]["p50"], s["e2e_s"]["p99"]]
        drawn = bars.bar([g + (i - (len(labels) - 1) / 2) * width for g in range(len(groups))],
                         [v or 0 for v in values], width, color=COLORS.get(strategy), label=strategy)
        bars.bar_label(drawn, fmt="%.2f", fontsize=7, padding=2)
    cdf.set(xscale="log", xlabel="TTFT (s, log scale)", ylabel="fraction of successful requests",
            title="TTFT CDF per routing strategy")
    bars.set_xticks(range(len(groups)), groups)
    bars.set(ylabel="seconds", title="latency percentiles (lower is better)")
    seqs = ", ".join(str(e["max_num_seqs"]) for e in report["engines"].values())
    fig.suptitle(f"{len(report['engines'])} engines (max-num-seqs {seqs}), capacity "
                 f"{report['capacity_requests_per_s']:.1f} req/s, Poisson at {report['rate']:.1f} req/s "
                 f"({report['load']:.0%}); p99 TTFT kvfleet / round-robin = "
                 f"{_x(report.get('p99_ttft_ratio_kvfleet_to_round_robin'))}")
    return finish(fig, path, (cdf, bars))


if __name__ == "__main__":
    main()
