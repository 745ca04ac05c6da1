"""The simulator's command line: every policy on the same seeded traces, then the JSON report, table and chart."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import bench.autoscaler_sim as autoscaler_sim
from bench.autoscaler_sim.model import EngineModel, Policy, simulate
from bench.autoscaler_sim.policies import KvfleetPolicy, policies, sweep_variants
from bench.autoscaler_sim.report import (
    SLO_TTFT_S,
    TARGET_REPLICA_RATIO,
    TARGET_SLO,
    arrivals_per_second,
    relate,
    replot,
    summarize,
    write,
)
from bench.autoscaler_sim.workloads import Trace, bursty_trace


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.autoscaler_sim",
                                     description=autoscaler_sim.__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="of the first trace (the one charted over time)")
    parser.add_argument("--seeds", type=int, default=3, help="traces (seed, seed+1, ...); figures pool them")
    parser.add_argument("--duration", type=int, default=7200, help="seconds of simulated traffic per trace")
    parser.add_argument("--capacity", type=float, default=1.2, help="requests/s of one pod at a full batch")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cold-start", type=int, default=30, help="seconds before a new pod is ready")
    parser.add_argument("--max-replicas", type=int, default=64, help="for every policy")
    parser.add_argument("--rate-target", type=float, default=0.7,
                        help="HPA on request rate: target per replica as a fraction of a pod's capacity")
    parser.add_argument("--no-sweep", action="store_true", help="skip the kvfleet parameter sweep")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.seeds < 1 or args.duration < 3600:  # the trace's idle stretch and its five bursts need an hour
        parser.error("--seeds must be >= 1 and --duration >= 3600")
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        replot(args.replot)
        return
    started = time.monotonic()
    try:
        engine = EngineModel(capacity_rps=args.capacity, max_num_seqs=args.max_num_seqs,
                             cold_start_s=args.cold_start)
    except ValueError as error:
        sys.exit(f"autoscaler_sim: {error}")
    traces = [bursty_trace(seed=args.seed + k, duration_s=args.duration) for k in range(args.seeds)]
    runs = {name: _compare(traces, make, engine) for name, make in
            policies(args.max_replicas, engine, args.rate_target).items()}
    queue = runs["queue length (KEDA)"]
    for run in runs.values():
        relate(run, queue)
    sweep = {}
    if not args.no_sweep and not runs["kvfleet (min 1)"]["meets_target"]:
        for name, policy in sweep_variants(args.max_replicas).items():
            sweep[name] = _compare(traces, lambda policy=policy: KvfleetPolicy(policy), engine, detail=False)
            relate(sweep[name], queue)
    write({
        "command": shlex.join(["python", "-m", "bench.autoscaler_sim", *sys.argv[1:]]),
        "engine": asdict(engine), "seeds": [args.seed + k for k in range(args.seeds)], "duration_s": args.duration,
        "requests": sum(len(t.arrivals) for t in traces), "bursts": [list(t.bursts) for t in traces],
        "max_replicas": args.max_replicas, "rate_target_per_replica": args.rate_target * engine.capacity_rps,
        "slo_ttft_s": SLO_TTFT_S,
        "target": {"slo_attainment": TARGET_SLO, "replica_seconds_vs_queue": TARGET_REPLICA_RATIO},
        "arrivals_per_s": arrivals_per_second(traces[0]), "runs": runs, "sweep": sweep,
        "wall_s": time.monotonic() - started,
    }, args.out)


def _compare(traces: list[Trace], make: Callable[[], Policy], engine: EngineModel, detail: bool = True) -> dict:
    """One policy (a fresh one per trace) on every trace, summarized."""
    return summarize([simulate(trace, make(), engine) for trace in traces], detail)


if __name__ == "__main__":
    main()
