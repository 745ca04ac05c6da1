"""The simulator's command line: every policy on the same seeded trace at each load, then the JSON, table and chart."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import bench.prefix_sim as prefix_sim
from bench.prefix_sim.calibrate import Calibration
from bench.prefix_sim.engine import EngineShape
from bench.prefix_sim.gateway import POLICIES
from bench.prefix_sim.model import FleetShape, fleet_capacity_rps, simulate
from bench.prefix_sim.peers import SGLANG
from bench.prefix_sim.report import relate, summarize, write
from bench.prefix_sim.workload import WorkloadShape, poisson_trace

QUICK = {"engines": 8, "replicas": 2, "tenants": 100, "duration": 240.0, "warmup": 120.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_sim", description=prefix_sim.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a small fleet for a smoke run (<1 min): {QUICK}")
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=8, help="gateway replicas, each with its own view")
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0, help="tenant popularity exponent")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 0.95],
                        help="arrival rates as shares of the fleet's capacity (see --capacity-miss)")
    parser.add_argument("--capacity-miss", type=float, default=0.3,
                        help="share of system-prompt tokens missed when sizing the fleet's capacity")
    parser.add_argument("--duration", type=float, default=200.0, help="simulated seconds of arrivals")
    parser.add_argument("--warmup", type=float, default=100.0,
                        help="seconds whose requests fill caches, not figures (arrivals ramp up over them)")
    parser.add_argument("--num-blocks", type=int, default=EngineShape.num_blocks, help="KV blocks per engine")
    parser.add_argument("--block-size", type=int, default=EngineShape.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=EngineShape.max_num_seqs)
    parser.add_argument("--event-delay-ms", type=float, nargs=2, default=[5.0, 50.0], metavar=("LOW", "HIGH"))
    parser.add_argument("--calibration", type=Path,
                        help="JSON with prefill_tokens_per_s and decode_step_s {batch: seconds} (e.g. GPU figures)")
    parser.add_argument("--policies", nargs="+", default=[*POLICIES, SGLANG], choices=[*POLICIES, SGLANG],
                        metavar="POLICY")
    parser.add_argument("--system-tokens", type=int, nargs=2, default=list(WorkloadShape.system_tokens),
                        metavar=("LOW", "HIGH"), help="each tenant's system prompt length, uniform")
    parser.add_argument("--question-tokens", type=int, nargs=2, default=list(WorkloadShape.question_tokens),
                        metavar=("LOW", "HIGH"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=list(WorkloadShape.output_tokens),
                        metavar=("LOW", "HIGH"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", help="of the files written: NAME.json, .md, .png (default prefix_sim[_quick])")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if not 0 <= args.warmup < args.duration or not all(0 < load <= 2 for load in args.loads):
        parser.error("--warmup must be in [0, --duration) and each --loads in (0, 2]")
    if args.name is not None and not args.name.replace("_", "").replace("-", "").isalnum():
        parser.error("--name takes letters, digits, '-' and '_' only")
    return args


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    try:
        calibration = Calibration.load(args.calibration) if args.calibration else Calibration()
        engine = EngineShape(args.num_blocks, args.block_size, args.max_num_seqs)
        fleet = FleetShape(args.engines, args.replicas, (args.event_delay_ms[0] / 1e3, args.event_delay_ms[1] / 1e3),
                           engine)
        workload = WorkloadShape(args.tenants, tuple(args.system_tokens), tuple(args.question_tokens),
                                 tuple(args.output_tokens), args.zipf)
    except (ValueError, OSError, KeyError) as error:
        sys.exit(f"prefix_sim: {error}")
    capacity = fleet_capacity_rps(fleet, workload.mean_prompt_tokens, sum(workload.system_tokens) / 2,
                                  workload.mean_output_tokens, calibration, args.capacity_miss)
    sweep = []
    for load in args.loads:
        trace = poisson_trace(workload, load * capacity, args.duration, args.seed, ramp_s=args.warmup)
        runs = {}
        for policy in args.policies:
            began = time.monotonic()
            run = simulate(trace, policy, fleet, calibration, args.duration, args.seed)
            runs[policy] = {**summarize(run, args.warmup, args.duration), "wall_s": time.monotonic() - began}
            print(f"load {load:.2f} {policy}: {runs[policy]['wall_s']:.1f} s wall, p90 TTFT "
                  f"{runs[policy]['ttft_p90_s']}, hit rate {runs[policy]['prefix_hit_rate']:.1%}", flush=True)
        relate(runs)
        sweep.append({"load": load, "rate_rps": load * capacity, "requests": len(trace), "runs": runs})
    name = args.name or ("prefix_sim_quick" if args.quick else "prefix_sim")
    write({"command": shlex.join(["python", "-m", "bench.prefix_sim", *sys.argv[1:]]),
           "calibration": {**asdict(calibration), "decode_step_s": {str(b): s for b, s in
                                                                    calibration.decode_step_s.items()}},
           "fleet": {"engines": fleet.engines, "replicas": fleet.replicas, "event_delay_s": fleet.event_delay_s,
                     "engine": asdict(engine)},
           "workload": asdict(workload), "capacity_rps": capacity, "capacity_miss": args.capacity_miss,
           "duration_s": args.duration, "warmup_s": args.warmup, "seed": args.seed, "sweep": sweep,
           "wall_s": time.monotonic() - started}, args.out, name)


if __name__ == "__main__":
    main()
