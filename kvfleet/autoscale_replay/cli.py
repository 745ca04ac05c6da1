"""`kvfleet bench autoscale`: replay a trace (a CSV file or a bundled workload) under autoscaling policies and
report each one's SLO attainment per class against its replica-seconds."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvfleet.autoscale_replay.batch import JOB_COLUMNS, read_jobs_csv
from kvfleet.autoscale_replay.engine_model import EngineModel
from kvfleet.autoscale_replay.replay import POLICY_NAMES, Settings, replay
from kvfleet.autoscale_replay.report import chart, format_table
from kvfleet.autoscale_replay.slo import DEFAULT_ATTAINMENT, DEFAULT_TTFT_S, Slo, parse_classes
from kvfleet.autoscale_replay.trace import COLUMNS, Trace, read_csv
from kvfleet.autoscale_replay.workloads import WORKLOADS

PROG = "kvfleet bench autoscale"


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineModel()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] + " " + __doc__.splitlines()[1])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, metavar="FILE",
                        help=f"CSV with a header row and the columns {','.join(COLUMNS)} (t: seconds from start; "
                             "priority: critical, standard or sheddable); other columns are ignored")
    source.add_argument("--workload", choices=list(WORKLOADS), help="a bundled workload (--list-workloads)")
    p.add_argument("--batch-jobs", type=Path, metavar="FILE",
                   help=f"CSV of Batch API jobs to run beside the trace, one per row: {','.join(JOB_COLUMNS)} (t: "
                        "seconds from start when the batch is created; requests, and each one's prompt and output "
                        "tokens; window_s: its completion window); the replay lasts until the last deadline")
    p.add_argument("--list-workloads", action="store_true", help="describe the bundled workloads and exit")
    p.add_argument("--seed", type=int, default=0, help="of a bundled workload")
    p.add_argument("--policy", action="append", choices=POLICY_NAMES, metavar="NAME",
                   help=f"repeatable: {', '.join(POLICY_NAMES)} (default: all)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON (then no chart)")
    p.add_argument("--chart", type=Path, default=Path("autoscale-replay.png"),
                   help="where the chart goes without --json (default: %(default)s)")
    p.add_argument("--slo", default="", metavar="CLASS=S,...",
                   help="TTFT objective in seconds per class (default: "
                        + ",".join(f"{k.value}={v:g}" for k, v in DEFAULT_TTFT_S.items()) + ")")
    p.add_argument("--attainment", default="", metavar="CLASS=F,...",
                   help="share of a class's requests that must meet its objective (default: "
                        + ",".join(f"{k.value}={v:g}" for k, v in DEFAULT_ATTAINMENT.items()) + ")")
    p.add_argument("--max-replicas", type=int, default=Settings.max_replicas,
                   help="for every policy (default: %(default)s)")
    p.add_argument("--critical-lane", action="store_true",
                   help="kvfleet's critical lane (the gateway's --critical-lane, spec.autoscaling.criticalLane): one "
                        "pod takes no lower-class requests while critical ones come, and the planner adds it")
    p.add_argument("--warm-pool", type=int, default=Settings.warm_pool,
                   help="kvfleet's warm pool (spec.autoscaling.warmPool.replicas): pods kept asleep with the model "
                        "loaded, woken first on a scale-up; counted apart as asleep_replica_seconds (default: none)")
    p.add_argument("--wake-seconds", type=float, default=Settings.wake_s,
                   help="how long a pod of the warm pool takes to serve again (default: %(default)s)")
    m = p.add_argument_group("engine model (defaults: SmolLM2-135M on 2 CPU cores, from the engine benchmark)")
    m.add_argument("--cold-start", type=int, default=defaults.cold_start_s, help="seconds before a new pod is ready")
    m.add_argument("--capacity", type=float, default=defaults.capacity_rps,
                   help="requests/s of one pod at a full batch, for requests of 136 prompt and 64 output tokens")
    m.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="a pod's batch")
    m.add_argument("--prefill-tokens-per-s", type=float, default=defaults.prefill_tokens_per_s)
    m.add_argument("--kv-per-request", type=float, default=defaults.kv_per_request,
                   help="share of a pod's KV cache one running request holds")
    m.add_argument("--prefill-chunk-tokens", type=int, default=defaults.prefill_chunk_tokens,
                   help="the most prompt tokens of one request a step computes (the engines' "
                        "--long-prefill-token-threshold): a higher-priority prompt starts after the current chunk of "
                        "one already prefilling; 0: whole prompts (default)")
    return p


def list_workloads() -> str:
    return "\n".join(f"{name:<12} {make.__doc__.splitlines()[0]}" for name, make in WORKLOADS.items())


def load_trace(args: argparse.Namespace) -> tuple[Trace, str]:
    if args.trace is not None:
        trace, source = read_csv(args.trace), str(args.trace)
    elif args.workload is not None:
        trace, source = WORKLOADS[args.workload](args.seed), f"workload {args.workload} (seed {args.seed})"
    else:
        raise ValueError("give --trace FILE (a CSV) or --workload NAME (--list-workloads names them)")
    if args.batch_jobs is None:
        return trace, source
    return trace.with_jobs(read_jobs_csv(args.batch_jobs)), f"{source} with the batch jobs of {args.batch_jobs}"


def run(args: argparse.Namespace) -> int:
    if args.list_workloads:
        print(list_workloads())
        return 0
    engine = EngineModel(capacity_rps=args.capacity, max_num_seqs=args.max_num_seqs,
                         prefill_tokens_per_s=args.prefill_tokens_per_s, kv_per_request=args.kv_per_request,
                         cold_start_s=args.cold_start, prefill_chunk_tokens=args.prefill_chunk_tokens)
    slo = Slo(parse_classes(args.slo, "--slo", DEFAULT_TTFT_S),
              parse_classes(args.attainment, "--attainment", DEFAULT_ATTAINMENT))
    settings = Settings(engine, slo, args.max_replicas, args.warm_pool, args.wake_seconds, args.critical_lane)
    trace, source = load_trace(args)
    results = replay(trace, args.policy or list(POLICY_NAMES), settings)
    print(format_table(results, source))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
        return 0
    path = chart(results, args.chart, f"{source}: {trace.duration_s:,} s, cold start {engine.cold_start_s} s")
    if path:
        print(f"chart: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as err:  # a trace or setting the user can fix: say what to change
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
