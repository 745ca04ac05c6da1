"""What `kvfleet bench autoscale` shows: the table of policies (attainment per class, replica-seconds, ratio to the
oracle's) and the chart of attainment against replica-seconds, one panel per class with a target."""

from __future__ import annotations

from pathlib import Path

from kvfleet.fleet.priority import Priority

COLORS = {"kvfleet": "tab:green", "keda-queue": "tab:blue", "hpa-kv": "tab:purple", "kpa": "tab:orange",
          "oracle": "black"}


def format_table(results: dict[str, dict], source: str) -> str:
    """One row per policy, then the objectives they were scored against."""
    classes = [p.value for p in Priority]
    oracle = results.get("oracle", {}).get("replica_seconds")
    header = (f"{'policy':<11} " + " ".join(f"{c:>10}" for c in classes) + f" {'replica-s':>10} {'÷ oracle':>8} "
              + f"{'shed c/s/s':>16} {'wall':>6}")
    rows = [f"{source}: {_requests(results)}", header]
    for name, r in results.items():
        ratio = f"{r['replica_seconds'] / oracle:.2f}" if oracle else "-"
        rows.append(f"{name:<11} " + " ".join(f"{_pct(r['slo_attainment'][c]):>10}" for c in classes)
                    + f" {r['replica_seconds']:>10,} {ratio:>8} {'/'.join(str(r['shed'][c]) for c in classes):>16}"
                    + f" {r['wall_s']:>5.1f}s")
    settings = next(iter(results.values()))["settings"]
    rows.append("attainment = share of a class's requests with TTFT within "
                + ", ".join(f"{c} {settings['slo_ttft_s'][c]:g} s (target {settings['attainment_target'][c]:.1%})"
                            for c in classes)
                + f"; cold start {settings['engine']['cold_start_s']} s; shed requests miss")
    if settings.get("kvfleet_warm_pool") and "kvfleet" in results:
        rows.append(f"kvfleet kept a warm pool of {settings['kvfleet_warm_pool']} (awake in {settings['wake_s']:g} s): "
                    f"{results['kvfleet']['asleep_replica_seconds']:,} of its replica-s were asleep")
    if "oracle" in results and not results["oracle"].get("meets_targets", True):
        rows.append("the oracle found no schedule meeting the targets within --max-replicas")
    first = next(iter(results.values()))
    short = [c for c in classes if first["feasible"][c] is not None and first["feasible"][c] < 1]
    if short:
        rows.append("of the requests any policy could serve in time (prefill alone within the objective; "
                    + ", ".join(f"{_pct(first['feasible'][c])} of {c}" for c in short) + "):")
        rows.extend(f"{name:<11} " + " ".join(f"{_pct(r['feasible_attainment'][c]):>10}" for c in classes)
                    for name, r in results.items())
    if any("batch" in r for r in results.values()):
        rows.extend(batch_rows(results))
    return "\n".join(rows)


def batch_rows(results: dict[str, dict]) -> list[str]:
    """Per policy: the batch jobs finished by their deadline, their requests answered in time, and each job's
    finish against its deadline (the oracle plans for the interactive classes only)."""
    rows = ["batch jobs (finished at / deadline, seconds from start; '-': not finished):"]
    for name, r in results.items():
        b = r["batch"]
        jobs = " ".join(f"{_seconds(j['finished_s'])}/{j['deadline_s']:,.0f}" for j in b["jobs"][:6])
        jobs += " ..." if len(b["jobs"]) > 6 else ""
        rows.append(f"{name:<11} {b['jobs_on_time']}/{len(b['jobs'])} on time, "
                    f"{b['answered_on_time']:,}/{b['requests']:,} requests in time: {jobs}")
    return rows


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _requests(results: dict[str, dict]) -> str:
    counts = next(iter(results.values()))["requests"]
    return f"{sum(counts.values()):,} requests (" + ", ".join(f"{n:,} {c}" for c, n in counts.items()) + ")"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def chart(results: dict[str, dict], path: Path, title: str) -> Path | None:
    """Attainment against replica-seconds per policy, a panel per class; None (said on stdout) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvfleet[bench]'); no chart written")
        return None
    classes = [p.value for p in Priority]
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4.5), sharex=True)
    settings = next(iter(results.values()))["settings"]
    for ax, c in zip(axes, classes, strict=True):
        for name, r in results.items():
            if r["slo_attainment"][c] is not None:
                ax.scatter(r["replica_seconds"], 100 * r["slo_attainment"][c], color=COLORS.get(name), s=50,
                           label=name, marker="*" if name == "oracle" else "o")
                ax.annotate(name, (r["replica_seconds"], 100 * r["slo_attainment"][c]), fontsize=8,
                            xytext=(4, 4), textcoords="offset points")
        target = settings["attainment_target"][c]
        if target > 0:
            ax.axhline(100 * target, color="tab:red", ls="--", lw=1, label=f"target {target:.1%}")
        ax.set(title=f"{c}: TTFT <= {settings['slo_ttft_s'][c]:g} s", xlabel="replica-seconds",
               ylabel="requests within the objective (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
