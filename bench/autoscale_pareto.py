"""Attainment against replica-seconds for each autoscaling policy over a sweep of its own setting, on every bundled
workload (issue 17's Pareto plot): is kvfleet's planner on the frontier, or does another policy, set differently,
buy the same attainment for less?

    python -m bench.autoscale_pareto [--seed 0] [--out docs/benchmarks/autoscale_pareto]

Per workload and policy setting: critical and standard attainment and replica-seconds divided by the oracle's (the
oracle is planned once per workload, as `kvfleet bench autoscale` does). Writes OUT.json and OUT.png (one panel per
workload: standard attainment against replica-seconds ÷ oracle; hollow markers where critical missed 99.9 %).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvfleet.autoscale_replay.fleet import simulate
from kvfleet.autoscale_replay.kpa import TICK_S, KpaPolicy
from kvfleet.autoscale_replay.policies import KvfleetPolicy, hpa_kv, keda_queue
from kvfleet.autoscale_replay.replay import INITIAL_REPLICAS, PERIOD_S, TAIL_S, Settings, requests_of, run_policy
from kvfleet.autoscale_replay.slo import score
from kvfleet.autoscale_replay.workloads import WORKLOADS
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.config import DEFAULT_CAPS
from kvfleet.operator.autoscaler import AutoscalingPolicy

# Each policy's own knob, around its default (marked *).
SWEEPS = {
    "kvfleet": ("planner utilization", [0.6, 0.75, 0.9, 1.0], 0.9,
                lambda v, n: (KvfleetPolicy(AutoscalingPolicy(min_replicas=1, max_replicas=n,
                                                              planner_utilization=v)), PERIOD_S)),
    "keda-queue": ("waiting per replica", [1, 2, 5, 10], 5, lambda v, n: (keda_queue(n, v), PERIOD_S)),
    "hpa-kv": ("KV usage target", [0.2, 0.4, 0.7], 0.7, lambda v, n: (hpa_kv(n, v), PERIOD_S)),
    "kpa": ("concurrency per pod", [16, 32, 64, 128], 64, lambda v, n: (KpaPolicy(target=v, max_replicas=n), TICK_S)),
}
COLORS = {"kvfleet": "tab:green", "keda-queue": "tab:blue", "hpa-kv": "tab:purple", "kpa": "tab:orange"}


def sweep(seed: int) -> dict:
    settings = Settings()
    out: dict = {}
    for workload, make_trace in WORKLOADS.items():
        trace = make_trace(seed)
        oracle = run_policy(trace, "oracle", settings)
        rows = []
        for name, (knob, values, default, make) in SWEEPS.items():
            for value in values:
                policy, period = make(value, settings.max_replicas)
                run = simulate(requests_of(trace, settings.engine), trace.duration_s, policy, settings.engine,
                               INITIAL_REPLICAS, period, TAIL_S, DEFAULT_CAPS)
                s = score(run, settings.slo)
                rows.append({"policy": name, "knob": knob, "value": value, "default": value == default,
                             "critical": s["slo_attainment"][Priority.CRITICAL.value],
                             "standard": s["slo_attainment"][Priority.STANDARD.value],
                             "replica_seconds": s["replica_seconds"],
                             "vs_oracle": round(s["replica_seconds"] / oracle["replica_seconds"], 3)})
        out[workload] = {"oracle": {k: oracle[k] for k in ("slo_attainment", "replica_seconds", "meets_targets")},
                         "runs": rows}
        print(workload, "done", flush=True)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(13, 8), sharey=True)
    axes = list(grid.flat)
    for ax, (workload, r) in zip(axes, results.items(), strict=False):  # the sixth panel holds the legend
        for name in SWEEPS:
            rows = sorted((x for x in r["runs"] if x["policy"] == name), key=lambda x: x["vs_oracle"])
            xs, ys = [x["vs_oracle"] for x in rows], [100 * x["standard"] for x in rows]
            ax.plot(xs, ys, color=COLORS[name], lw=1, alpha=0.6)
            for x in rows:
                met = x["critical"] >= 0.999
                ax.scatter(x["vs_oracle"], 100 * x["standard"], s=60 if x["default"] else 25,
                           facecolors=COLORS[name] if met else "none", edgecolors=COLORS[name])
        ax.scatter(1.0, 100 * r["oracle"]["slo_attainment"]["standard"], marker="*", s=120, color="black")
        ax.axvline(1.5, color="tab:red", ls=":", lw=1)
        ax.set(title=workload, xlabel="replica-seconds ÷ oracle's", xlim=(0, 4.5))
        ax.grid(alpha=0.3)
    for row in grid:
        row[0].set_ylabel("standard requests within 2 s (%)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", label=name) for name, c in COLORS.items()]
    handles.append(Line2D([], [], color="black", marker="*", ls="", markersize=12, label="oracle"))
    axes[-1].axis("off")
    axes[-1].legend(handles=handles, loc="center")
    fig.suptitle("Autoscaling policies over their own setting (big marker: default; hollow: critical < 99.9 %; "
                 "dotted: 1.5x the oracle)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/benchmarks/autoscale_pareto")
    args = parser.parse_args()
    started = time.monotonic()
    results = sweep(args.seed)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"seed": args.seed, "workloads": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}.json and {out}.png in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
