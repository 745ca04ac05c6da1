"""The autoscaler judged on traffic it was not tuned on (issue 40): every held-out workload
(kvfleet/autoscale_replay/held_out.py) at seeds never used in development, replayed under kvfleet's policy, KEDA's
queue recipe, HPA on KV usage and the oracle, with a 30 s cold start. Reports per trace the targets' figures:

- critical: attainment among the requests any policy could serve in time, against the oracle's (within 0.1 points),
  with the feasible share beside it;
- standard: kvfleet's attainment against KEDA's, at what ratio of KEDA's replica-seconds (<= 0.8x) and of the
  oracle's (<= 1.5x);
and a Pareto chart (replica-seconds against critical and standard attainment) per trace.

    python -m bench.autoscale_heldout --json heldout.json --chart heldout.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvfleet.autoscale_replay.engine_model import EngineModel
from kvfleet.autoscale_replay.held_out import HELD_OUT
from kvfleet.autoscale_replay.replay import Settings, replay

POLICIES = ("kvfleet", "keda-queue", "hpa-kv", "oracle")
SEEDS = (101, 202)  # never used while the policy was developed (its workloads ran seeds 0-9)


def judge(results: dict[str, dict]) -> dict:
    """The issue's targets on one trace's results."""
    kv, keda, oracle = results["kvfleet"], results["keda-queue"], results["oracle"]
    return {
        "critical_feasible_share": kv["feasible"]["critical"],
        "critical_of_feasible": {name: r["feasible_attainment"]["critical"] for name, r in results.items()},
        "critical_gap_to_oracle_points": 100 * (oracle["feasible_attainment"]["critical"]
                                                - kv["feasible_attainment"]["critical"]),
        "standard": {name: r["slo_attainment"]["standard"] for name, r in results.items()},
        "replica_seconds": {name: r["replica_seconds"] for name, r in results.items()},
        "kvfleet_vs_keda_replica_seconds": kv["replica_seconds"] / keda["replica_seconds"],
        "kvfleet_vs_oracle_replica_seconds": kv["replica_seconds"] / oracle["replica_seconds"],
        # the warm pool's asleep pods not counted (their accelerator free for other work while they sleep)
        "kvfleet_awake_vs_keda_replica_seconds": (kv["replica_seconds"] - kv["asleep_replica_seconds"])
        / keda["replica_seconds"],
        "critical_met": oracle["feasible_attainment"]["critical"] - kv["feasible_attainment"]["critical"] <= 0.001,
        "standard_met": (kv["slo_attainment"]["standard"] >= keda["slo_attainment"]["standard"]
                         and kv["replica_seconds"] <= 0.8 * keda["replica_seconds"]
                         and kv["replica_seconds"] <= 1.5 * oracle["replica_seconds"]),
    }


def chart(report: dict, path: Path) -> None:
    """Two panels (critical among the feasible, standard): each policy's point per trace, replica-seconds as a
    multiple of the oracle's on that trace against attainment, so traces of any size share the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"kvfleet": "tab:green", "keda-queue": "tab:blue", "hpa-kv": "tab:purple", "oracle": "black"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, (cls, key) in zip(axes, (("critical", "feasible_attainment"), ("standard", "slo_attainment")),
                              strict=True):
        for policy in POLICIES:
            xs, ys = [], []
            for trace in report["traces"].values():
                results = trace["results"]
                value = results[policy][key][cls]
                if value is not None:
                    xs.append(results[policy]["replica_seconds"] / results["oracle"]["replica_seconds"])
                    ys.append(100 * value)
            ax.scatter(xs, ys, color=colors[policy], s=30, alpha=0.8, label=policy,
                       marker="*" if policy == "oracle" else "o")
        ax.set(title=f"{cls}" + (" (among the requests any policy could serve in time)" if cls == "critical" else ""),
               xlabel="replica-seconds ÷ the oracle's on the same trace", ylabel="within the TTFT objective (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    lane = " (kvfleet with its critical lane)" if "--critical-lane" in report["command"] else ""
    fig.suptitle(f"held-out traces ({len(report['traces'])}): bursts, a flash crowd, a noisy day, Azure's hour; "
                 f"cold start 30 s{lane}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, action="append", help=f"repeatable (default: {SEEDS})")
    p.add_argument("--workload", action="append", choices=list(HELD_OUT), help="repeatable (default: all)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=0,
                   help="the engine model's chunk (the engines' --long-prefill-token-threshold); 0: whole prompts")
    p.add_argument("--warm-pool", type=int, default=0, help="kvfleet's warm pool: pods kept asleep (0: none)")
    p.add_argument("--critical-lane", action="store_true", help="kvfleet's critical lane (one pod for critical)")
    p.add_argument("--wake-seconds", type=float, default=5.0, help="how long an asleep pod takes to serve again")
    p.add_argument("--json", type=Path)
    p.add_argument("--chart", type=Path)
    args = p.parse_args(argv)
    report = {"command": " ".join(["python", "-m", "bench.autoscale_heldout", *(argv or sys.argv[1:])]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "policies": POLICIES, "traces": {}}
    for workload in args.workload or list(HELD_OUT):
        for seed in args.seed or SEEDS:
            name = f"{workload}/s{seed}"
            engine = EngineModel(prefill_chunk_tokens=args.prefill_chunk_tokens)
            results = replay(HELD_OUT[workload](seed), list(POLICIES),
                             Settings(engine, warm_pool=args.warm_pool, wake_s=args.wake_seconds,
                                      critical_lane=args.critical_lane))
            verdict = judge(results)
            report["traces"][name] = {"results": results, "judged": verdict}
            crit = verdict["critical_of_feasible"]
            print(f"{name:<20} critical of feasible ({verdict['critical_feasible_share']:.1%} feasible): "
                  f"kvfleet {crit['kvfleet']:.2%} oracle {crit['oracle']:.2%} keda {crit['keda-queue']:.2%} | "
                  f"standard kvfleet {verdict['standard']['kvfleet']:.2%} keda {verdict['standard']['keda-queue']:.2%}"
                  f" | replica-s ÷ keda {verdict['kvfleet_vs_keda_replica_seconds']:.2f} ÷ oracle "
                  f"{verdict['kvfleet_vs_oracle_replica_seconds']:.2f} (awake ÷ keda "
                  f"{verdict['kvfleet_awake_vs_keda_replica_seconds']:.2f}) | critical "
                  f"{'met' if verdict['critical_met'] else 'missed'}, standard "
                  f"{'met' if verdict['standard_met'] else 'missed'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.chart:
        chart(report, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
