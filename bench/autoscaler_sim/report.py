"""What a simulated run produced and the figures drawn from it: SLO attainment, TTFT quantiles and
replica-seconds per policy, compared with the queue-length policy, as the JSON report, a table and a chart."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bench.autoscaler_sim.workloads import Trace
from bench.plotting import finish, pyplot

SLO_TTFT_S = 2.0
TARGET_SLO = 0.99
TARGET_REPLICA_RATIO = 0.8


@dataclass
class SimResult:
    """One simulation's outcome, request by request and second by second."""

    ttfts: list[float]  # inf for requests without a first token when the simulation stopped
    in_burst: list[bool]  # whether each request arrived during a burst
    replicas: list[int]  # the Deployment's replicas at each second of the trace
    pods: list[int]  # every pod that costs: starting, ready, draining
    completed: int
    in_pods: int  # running or waiting in a pod when the simulation stopped
    gateway_queued: int

    def summary(self) -> dict:
        """SLO attainment (overall, in and outside bursts), TTFT quantiles and replica-seconds."""
        ordered = sorted(self.ttfts)
        burst = [t for t, b in zip(self.ttfts, self.in_burst, strict=True) if b]
        calm = [t for t, b in zip(self.ttfts, self.in_burst, strict=True) if not b]
        return {"requests": len(ordered), "slo_attainment": _attainment(ordered),
                "slo_in_bursts": _attainment(burst), "slo_outside_bursts": _attainment(calm),
                "requests_in_bursts": len(burst),
                "replica_seconds": sum(self.pods), "mean_replicas": sum(self.pods) / max(1, len(self.pods)),
                "max_replicas": max(self.replicas, default=0),
                "ttft_p50_s": _quantile(ordered, 0.5), "ttft_p99_s": _quantile(ordered, 0.99),
                "ttft_max_s": _finite_or_none(ordered[-1]) if ordered else None,
                "no_first_token": sum(1 for t in ordered if math.isinf(t))}

    @staticmethod
    def pooled(results: list[SimResult]) -> SimResult:
        """Several traces' results as one: requests and seconds side by side."""
        return SimResult([t for r in results for t in r.ttfts], [b for r in results for b in r.in_burst],
                         [n for r in results for n in r.replicas], [n for r in results for n in r.pods],
                         sum(r.completed for r in results), sum(r.in_pods for r in results),
                         sum(r.gateway_queued for r in results))


def _attainment(ttfts: list[float]) -> float | None:
    return sum(1 for t in ttfts if t <= SLO_TTFT_S) / len(ttfts) if ttfts else None


def _quantile(ordered: list[float], q: float) -> float | None:
    return _finite_or_none(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else None


def _finite_or_none(value: float) -> float | None:
    return None if math.isinf(value) else value


def summarize(results: list[SimResult], detail: bool = True) -> dict:
    """One policy's runs on every trace: pooled figures, per-trace figures, and (detail) what the chart needs."""
    run = SimResult.pooled(results).summary() | {"per_trace": [r.summary() for r in results]}
    if detail:
        run |= {"replicas": results[0].replicas, "ttft_quantiles": _cdf(SimResult.pooled(results).ttfts)}
    return run


def relate(run: dict, queue: dict) -> None:
    """Add the run's replica-seconds as a ratio of the queue policy's, and whether it meets the target."""
    run["replica_seconds_vs_queue"] = run["replica_seconds"] / queue["replica_seconds"]
    for mine, theirs in zip(run["per_trace"], queue["per_trace"], strict=True):
        mine["replica_seconds_vs_queue"] = mine["replica_seconds"] / theirs["replica_seconds"]
    run["meets_target"] = run["slo_attainment"] >= TARGET_SLO and run["replica_seconds_vs_queue"] <= \
        TARGET_REPLICA_RATIO


def write(report: dict, out: Path) -> None:
    """The report as JSON under out, its table on stdout, and its chart next to the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "autoscaler_sim.json"
    path.write_text(json.dumps(report))
    print(format_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")


def replot(path: Path) -> None:
    """Redraw the chart of an earlier run's JSON, next to it."""
    chart(json.loads(path.read_text()), path.with_suffix(".png"))


def _cdf(ttfts: list[float], points: int = 500) -> list[float | None]:
    ordered = sorted(ttfts)
    return [_finite_or_none(ordered[min(len(ordered) - 1, round(k * (len(ordered) - 1) / points))])
            for k in range(points + 1)] if ordered else []


def arrivals_per_second(trace: Trace) -> list[int]:
    counts = [0] * trace.duration_s
    for at, _, _ in trace.arrivals:
        counts[int(at)] += 1
    return counts


def format_table(report: dict) -> str:
    """The comparison as a table of policies (and of sweep variants), with the target's verdict."""
    header = (f"{'policy':<26} {'SLO met':>8} {'in bursts':>9} {'outside':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'replica-s':>10} {'mean':>5} {'max':>4} {'÷ queue':>8}  per trace ÷ queue")
    kv = report["runs"]["kvfleet (min 1)"]
    engine = report["engine"]
    in_bursts = sum(t["requests_in_bursts"] for t in kv["per_trace"])
    lines = [f"\n{report['command']}",
             f"{len(report['seeds'])} traces (seeds {', '.join(map(str, report['seeds']))}) of "
             f"{report['duration_s']} s: {report['requests']} requests, {in_bursts / report['requests']:.0%} of "
             f"them in bursts; pods of {engine['capacity_rps']} req/s at a batch of {engine['max_num_seqs']}, cold "
             f"start {engine['cold_start_s']} s; SLO TTFT <= {report['slo_ttft_s']:g} s. Figures pool the traces.",
             header, *(_row(name, run) for name, run in report["runs"].items())]
    for name in ("kvfleet (min 1)", "kvfleet (min 0)"):
        run = report["runs"][name]
        lines.append(f"{name}: replica-seconds / queue policy's = {run['replica_seconds_vs_queue']:.2f}, SLO "
                     f"{run['slo_attainment']:.2%}; target >= {TARGET_SLO:.0%} at <= {TARGET_REPLICA_RATIO}x: "
                     f"{'met' if run['meets_target'] else 'NOT met'}")
    if report["sweep"]:
        meeting = [name for name, s in report["sweep"].items() if s["meets_target"]]
        reaching = [(s["replica_seconds_vs_queue"], name) for name, s in report["sweep"].items()
                    if s["slo_attainment"] >= TARGET_SLO]
        lines += ["kvfleet with other parameters (everything else default):", header.replace("policy  ", "variant "),
                  *(_row(name, s) for name, s in report["sweep"].items()),
                  "meets the target: " + (", ".join(meeting) if meeting else "none of these"),
                  "cheapest to reach the SLO: " + (f"{min(reaching)[1]} at {min(reaching)[0]:.2f}x the queue "
                                                  "policy's replica-seconds" if reaching else "none of these")]
    lines.append(f"simulated in {report['wall_s']:.1f} s")
    return "\n".join(lines)


def _row(name: str, run: dict) -> str:
    per_trace = " ".join(f"{t['replica_seconds_vs_queue']:.2f}" for t in run["per_trace"])
    return (f"{name:<26} {run['slo_attainment']:>8.2%} {_pct(run['slo_in_bursts']):>9} "
            f"{_pct(run['slo_outside_bursts']):>8} {_s(run['ttft_p50_s']):>9} {_s(run['ttft_p99_s']):>9} "
            f"{run['replica_seconds']:>10,} {run['mean_replicas']:>5.1f} {run['max_replicas']:>4} "
            f"{run['replica_seconds_vs_queue']:>8.2f}  {per_trace}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}s"


COLORS = {"kvfleet (min 1)": "tab:green", "kvfleet (min 0)": "tab:olive", "queue length (KEDA)": "tab:blue",
          "HPA on request rate": "tab:purple"}


def chart(report: dict, path: Path) -> Path | None:
    """Replicas over the first trace and the pooled TTFT CDF, per policy; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (over_time, cdf) = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [2.2, 1]})
    load = over_time.twinx()
    arrivals = report["arrivals_per_s"]
    smooth = [sum(arrivals[max(0, t - 9):t + 1]) / len(arrivals[max(0, t - 9):t + 1]) for t in range(len(arrivals))]
    load.fill_between([t / 60 for t in range(len(smooth))], smooth, color="0.85", step="post", zorder=0)
    load.set_ylabel("arrivals (requests/s, 10 s mean)", color="0.4")
    over_time.set_zorder(load.get_zorder() + 1)
    over_time.patch.set_visible(False)
    for name, run in report["runs"].items():
        label = (f"{name}: {run['per_trace'][0]['slo_attainment']:.1%} SLO, "
                 f"{run['per_trace'][0]['replica_seconds_vs_queue']:.2f}x queue's replica-s on this trace")
        over_time.step([t / 60 for t in range(len(run["replicas"]))], run["replicas"], where="post", lw=1.1,
                       color=COLORS.get(name), label=label)
        ttfts = [v for v in run["ttft_quantiles"] if v is not None]
        fractions = [k / (len(run["ttft_quantiles"]) - 1) for k in range(len(ttfts))]
        cdf.plot([max(v, 1e-2) for v in ttfts], fractions, color=COLORS.get(name), label=name)
    over_time.set(xlabel="minutes", ylabel="replicas ordered",
                  title=f"replicas per policy over the trace of seed {report['seeds'][0]}")
    over_time.legend(fontsize=8, loc="upper left")
    cdf.axvline(report["slo_ttft_s"], color="tab:red", ls="--", lw=1, label=f"SLO {report['slo_ttft_s']:g} s")
    cdf.set(xscale="log", xlabel="TTFT (s, log scale)", ylabel="fraction of requests",
            title=f"TTFT CDF, {len(report['seeds'])} traces pooled")
    cdf.legend(fontsize=8, loc="lower right")
    kv = report["runs"]["kvfleet (min 1)"]
    fig.suptitle(f"{report['requests']} requests in {len(report['seeds'])} traces, cold start "
                 f"{report['engine']['cold_start_s']} s; kvfleet (min 1): {kv['slo_attainment']:.2%} within "
                 f"{report['slo_ttft_s']:g} s at {kv['replica_seconds_vs_queue']:.2f}x the queue policy's replica-"
                 f"seconds (target >= {TARGET_SLO:.0%} at <= {TARGET_REPLICA_RATIO}x: "
                 f"{'met' if kv['meets_target'] else 'not met'})")
    return finish(fig, path, (over_time, cdf), legend_fontsize=None)
