"""What bench.gateway_overhead prints and draws from a run's JSON: latency per arm and each arm − direct, the CPU
each process spent per request at the peak, what dominates, issue 22's targets, and the chart. Pure functions over
the report, so an earlier run's JSON can be re-read or redrawn (--replot)."""

from __future__ import annotations

from pathlib import Path

from bench.loop_lag import describe_lag
from bench.overhead_targets import format_targets
from bench.plotting import finish, pyplot
from kvfleet.bench_report import percentile

COLORS = {"direct": "tab:gray", "gateway": "tab:green", "gateway-no-limit": "tab:blue",
          "gateway-no-migration": "tab:cyan", "gateway-envoy": "tab:orange", "gateway-envoy-no-migration": "tab:olive",
          "smg": "tab:red", "sglang-router": "tab:purple", "vllm-router": "tab:brown"}


def summarize_arms(latency: dict[str, list[dict]]) -> dict:
    """For all requests, streamed and not: p50/p99 end-to-end ms per arm, and each gateway arm − direct."""
    out: dict = {}
    for kind, keep in (("all", lambda r: True), ("stream", lambda r: r["stream"]),
                       ("non-stream", lambda r: not r["stream"])):
        row: dict = {}
        for arm, records in latency.items():
            e2e = [1000 * r["e2e_s"] for r in records if keep(r) and r["status"] == 200 and r["error"] is None]
            row[arm] = {"count": len(e2e), "p50_ms": percentile(e2e, 50), "p99_ms": percentile(e2e, 99)}
        row["added"] = {arm: {q: difference(row[arm][q], row["direct"][q]) for q in ("p50_ms", "p99_ms")}
                        for arm in latency if arm != "direct"}
        out[kind] = row
    out["all"]["added_median_of_rounds"] = {arm: median_round_difference(latency, arm)
                                            for arm in latency if arm != "direct"}
    return out


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def failed_by_arm(latency: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm with failures: how many, and the first one's status and error (to see why without the logs)."""
    out = {}
    for arm, records in latency.items():
        failed = [r for r in records if not (r["status"] == 200 and r["error"] is None)]
        if failed:
            out[arm] = {"failed": len(failed), "first": {"status": failed[0]["status"], "error": failed[0]["error"]}}
    return out


def median_round_difference(latency: dict[str, list[dict]], arm: str) -> dict[str, float]:
    """The median over rounds of (arm − direct) p50 and p99 within a round: one bad round cannot move it."""
    def e2e_ms(name: str, round_no: int) -> list[float]:
        return [1000 * r["e2e_s"] for r in latency[name]
                if r["round"] == round_no and r["status"] == 200 and r["error"] is None]

    diffs: dict[str, list[float]] = {"p50_ms": [], "p99_ms": []}
    for round_no in sorted({r["round"] for r in latency[arm]}):
        ours, direct = e2e_ms(arm, round_no), e2e_ms("direct", round_no)
        if ours and direct:
            for q in (50, 99):
                diffs[f"p{q}_ms"].append(percentile(ours, q) - percentile(direct, q))
    return {key: percentile(values, 50) for key, values in diffs.items()}


def serving_cpu(report: dict, arm: str) -> dict[str, float]:
    """CPU ms per request at the arm's peak: the engine, the gateway serving it (as 'gateway'), client, Redis;
    the idle gateway (it only scrapes) is left out."""
    serving = report["gateway_processes"].get(arm)
    gateways = set(report["gateway_processes"].values())
    per_request = report["peak"][arm]["cpu_ms_per_request"]
    return {("gateway" if name == serving else name): ms for name, ms in per_request.items()
            if name == serving or name not in gateways}


def what_dominates(report: dict) -> list[str]:
    """Two sentences read off the figures: what the Python gateway's added latency is, and what bounds its peak."""
    if not {"gateway", "gateway-no-limit"} <= set(arms_of(report)):
        return []
    lat, waits = report["latency"]["all"], report["gateway_queue_waits"]["gateway"]
    queued = sum(w["queued"] for w in waits.values())
    wait_ms = sum(1000 * (w["mean_wait_s"] or 0) * w["queued"] for w in waits.values()) / max(1, queued)
    added, proxy_only = lat["added"]["gateway"]["p50_ms"], lat["added"]["gateway-no-limit"]["p50_ms"]
    if queued > lat["gateway"]["count"] / 2 and proxy_only < added / 2:
        latency = (f"the added latency is mostly waiting in the gateway's fleet queue ({queued} of "
                   f"{lat['gateway']['count']} requests, {wait_ms:.1f} ms on average): its saturation policy counted "
                   f"the engine as saturated; proxying alone adds p50 {proxy_only:.2f} ms")
    else:
        latency = (f"the added latency is the proxying itself (p50 {added:.2f} ms; with the queue never used "
                   f"{proxy_only:.2f} ms)")
    peak = report["peak"]["gateway"]
    cpu = serving_cpu(report, "gateway")
    top = max(cpu, key=cpu.get)
    bound = (f"the gateway's peak ({peak['requests_per_s']:.0f} req/s) is set by its fleet queue "
             f"({peak['queued_in_gateway']} of {peak['requests']} requests waited), not by CPU"
             if peak["queued_in_gateway"] > peak["requests"] / 2 else
             f"the gateway's peak ({peak['requests_per_s']:.0f} req/s) is bounded by the shared CPU; "
             f"{top} costs the most per request ({cpu[top]:.2f} ms)")
    return [f"what dominates (Python proxy): {latency}.", f"{bound}."]


def arms_of(report: dict) -> list[str]:
    """The arms of a run, in order (runs from before the peers have no "arms" key)."""
    return report.get("arms") or list(report["peak"])


def rounds_of(report: dict) -> int:
    return len(next(iter(report["peak"].values()))["windows"])


def format_table(report: dict) -> str:
    lat, arms = report["latency"], arms_of(report)

    def cell(d: dict) -> str:
        return " /".join("      -" if d[q] is None else f"{d[q]:7.2f}" for q in ("p50_ms", "p99_ms"))

    rows = [f"{'p50 / p99 ms':<18}{'all':>18}{'streamed':>18}{'not streamed':>18}{'added':>18}"
            f"{'added, median of rounds':>26}"]
    for arm in arms:
        added = [cell(lat["all"][key][arm]) if arm in lat["all"][key] else ""
                 for key in ("added", "added_median_of_rounds")]
        rows.append(f"{arm:<18}" + "".join(f"{cell(lat[kind][arm]):>18}" for kind in ("all", "stream", "non-stream"))
                    + f"{added[0]:>18}{added[1]:>26}")
    waits = []
    for arm in (a for a in arms if a in report["gateway_queue_waits"]):
        w = report["gateway_queue_waits"][arm]
        queued = sum(v["queued"] for v in w.values())
        wait_ms = sum(1000 * (v["mean_wait_s"] or 0) * v["queued"] for v in w.values())
        waits.append(f"{arm}: {queued} of {lat['all'][arm]['count']} requests waited in its fleet queue"
                     + (f" (mean {wait_ms / queued:.1f} ms)" if queued else ""))
    peaks = [f"{arm} {report['peak'][arm]['requests_per_s']:.0f} req/s"
             + (f" ({report['peak'][arm]['queued_in_gateway']} of {report['peak'][arm]['requests']} queued)"
                if arm in report["gateway_queue_waits"] else "") for arm in arms]
    cpu_lines = []
    for arm in arms:
        cpu = serving_cpu(report, arm)
        line = f"  {arm:<17} " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
        split = report["peak"][arm].get("cpu_split_ms_per_request")
        if split:
            line += " (gateway = " + " + ".join(f"{k} {v:.2f}" for k, v in split.items()) + ")"
        if cpu.get("gateway"):
            line += f"  (the router alone on one core: ~{1000 / cpu['gateway']:.0f} req/s)"
        cpu_lines.append(line)
    peer_lines = [f"  {arm}: {p['version']} ({p['command']})" for arm, p in report.get("peers", {}).items()]
    python_added = ("" if report["added_p50_ms"] is None else
                    f"added by the Python-proxy gateway: p50 {report['added_p50_ms']:.2f} ms, "
                    f"p99 {report['added_p99_ms']:.2f} ms (below 0 means within this machine's noise)")
    return "\n".join(line for line in [
        f"\n{report['command']}",
        f"latency at concurrency {report['concurrency']}, {report['rounds']} rounds of {report['batch']} requests "
        f"per arm, arms rotated (max_tokens 1-4, streamed and not); {report['failures']} failures; "
        f"gateway-no-limit and gateway-envoy run with {report['no_limit_args']} (never counting the engine as "
        "saturated)",
        *rows, python_added,
        *(f"{arm}: {f['failed']} failed, the first with {f['first']['status']} {f['first']['error']}"
          for arm, f in report.get("failures_by_arm", {}).items()),
        "; ".join(waits),
        f"peak at concurrency {report['peak_concurrency']} (max_tokens 1, not streamed; median of "
        f"{rounds_of(report)} windows; "
        f"{report.get('peak_failures', 0)} failed): " + ", ".join(peaks),
        *(f"{arm}: {p['failed']} peak requests failed, the first with {first['status']} {first['error']}"
          for arm, p in report["peak"].items() if p.get("failed")
          for first in [next(w["first_failure"] for w in p["windows"] if w.get("first_failure"))]),
        "CPU ms per request at the peak (mean of the windows; all processes share this machine's cores):",
        *cpu_lines,
        *(["peer routers:", *peer_lines] if peer_lines else []),
        *what_dominates(report),
        describe_lag(report["client_loop_lag_s"]),
        format_targets(report) if "direct" in report["peak"] and "arms" in report else "",
    ] if line)


def chart(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    arms = arms_of(report)
    fig, (cdf, cpu) = plt.subplots(1, 2, figsize=(15, 5.5))
    for arm in arms:
        values = sorted(1000 * r["e2e_s"] for r in report["records"][arm]
                        if r["status"] == 200 and r["error"] is None)
        if values:
            cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                     color=COLORS.get(arm), label=arm)
    p99s = [report["latency"]["all"][arm]["p99_ms"] for arm in arms]
    if all(p99s):  # the tails past every arm's p99 would squeeze the part that differs
        cdf.set_xlim(0, 1.2 * max(p99s))
    focus = "gateway-envoy" if "gateway-envoy" in arms else "gateway"
    added = report["latency"]["all"]["added"].get(focus)
    cdf.set(xlabel="end-to-end latency (ms)", ylabel="fraction of requests",
            title=f"max_tokens 1-4, streamed and not, at concurrency {report['concurrency']}"
                  + (f": {focus} adds p50 {added['p50_ms']:.1f} / p99 {added['p99_ms']:.1f} ms" if added else ""))
    parts = {arm: serving_cpu(report, arm) for arm in arms}
    names = sorted({k for c in parts.values() for k in c}, key=lambda k: -max(c.get(k, 0) for c in parts.values()))
    bottom = [0.0] * len(arms)
    for name in names:
        values = [parts[arm].get(name, 0.0) for arm in arms]
        cpu.bar(arms, values, bottom=bottom, label="router" if name == "gateway" else name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, arm in enumerate(arms):
        cpu.annotate(f"{report['peak'][arm]['requests_per_s']:.0f} req/s", (i, bottom[i]), ha="center",
                     va="bottom", fontsize=9)
    cpu.tick_params(axis="x", labelrotation=20)
    cpu.set(ylabel="CPU ms per request", ylim=(0, max(bottom) * 1.15),
            title=f"CPU per request and peak req/s (concurrency {report['peak_concurrency']}, max_tokens 1)")
    return finish(fig, path, (cdf, cpu))
