"""Issue 22's targets read off one run of bench.gateway_overhead: a row per arm with its ratios to direct and to
the best peer, and each target with its figure, met or missed. Pure functions over the run's JSON."""

from __future__ import annotations

from kvfleet.bench_report import percentile

GATEWAY = "gateway-envoy"  # the arm the targets are about: Envoy carries the bytes, the picker decides
PEERS_TO_BEAT = ("smg", "sglang-router")
MIN_RATE_VS_BEST_PEER = 0.9
MIN_RATE_VS_DIRECT = 0.7
MAX_ROUTER_CPU_MS = 1.0
MAX_ADDED_P50_MS = 2.0
MAX_ADDED_P99_MS = 3.0
MAX_ENGINE_CPU_VS_DIRECT = 1.15


def engine_cpu_ms(report: dict, arm: str) -> float | None:
    """The engine's CPU ms per request at the arm's peak (the sum over engines, should there be several)."""
    per_request = report["peak"][arm]["cpu_ms_per_request"]
    values = [ms for name, ms in per_request.items() if name.startswith("engine")]
    return sum(values) if values else None


def router_cpu_ms(report: dict, arm: str) -> float | None:
    """CPU ms per request of the process tree serving the arm (a gateway with its Envoy, a peer router)."""
    serving = report["gateway_processes"].get(arm)
    return report["peak"][arm]["cpu_ms_per_request"].get(serving) if serving else None


def rate_ratio(report: dict, arm: str, reference: str) -> float:
    """The median over peak rounds of arm's req/s / reference's in the same round (runs without rounds: of the
    arms' peak rates), so that drift between rounds cancels."""
    def by_round(name: str) -> dict[int, float]:
        return {w["round"]: w["requests_per_s"] for w in report["peak"][name]["windows"] if "round" in w}

    ours, theirs = by_round(arm), by_round(reference)
    ratios = [ours[n] / theirs[n] for n in ours if theirs.get(n)]
    if not ratios:
        return report["peak"][arm]["requests_per_s"] / report["peak"][reference]["requests_per_s"]
    return percentile(ratios, 50)


def best_peer(report: dict) -> str | None:
    present = [arm for arm in PEERS_TO_BEAT if arm in report["peak"]]
    return max(present, key=lambda arm: report["peak"][arm]["requests_per_s"]) if present else None


def arm_rows(report: dict) -> list[dict]:
    """Per arm: peak req/s and its ratios, router and engine CPU per request, added p50/p99 vs direct (the median
    over rounds of the difference within a round)."""
    peer = best_peer(report)
    direct_engine = engine_cpu_ms(report, "direct")
    rows = []
    for arm in report["arms"]:
        rate, engine = report["peak"][arm]["requests_per_s"], engine_cpu_ms(report, arm)
        added = report["latency"]["all"]["added_median_of_rounds"].get(arm, {})  # within-round: drift cancels
        rows.append({"arm": arm, "requests_per_s": rate, "vs_direct": rate_ratio(report, arm, "direct"),
                     "vs_best_peer": rate_ratio(report, arm, peer) if peer else None,
                     "router_cpu_ms": router_cpu_ms(report, arm), "engine_cpu_ms": engine,
                     "engine_cpu_vs_direct": engine / direct_engine if engine and direct_engine else None,
                     "added_p50_ms": added.get("p50_ms"), "added_p99_ms": added.get("p99_ms")})
    return rows


def targets(report: dict, arm: str = GATEWAY) -> list[dict]:
    """Each of issue 22's targets for `arm`: what it asks, the figure, met (None when an arm it needs is missing)."""
    if arm not in report["peak"]:
        return [{"target": f"the {arm} arm", "figure": "not in this run", "met": None}]
    row = next(r for r in arm_rows(report) if r["arm"] == arm)
    peer = best_peer(report)
    out = []

    def add(target: str, figure: str, value: float | None, limit: float, at_least: bool = False) -> None:
        met = None if value is None else (value >= limit if at_least else value <= limit)
        out.append({"target": target, "figure": figure if value is not None else "not measured", "met": met})

    add(f"req/s at {report['peak_concurrency']} clients >= {MIN_RATE_VS_BEST_PEER}x the best of "
        f"{' and '.join(PEERS_TO_BEAT)}",
        f"{row['vs_best_peer']:.2f}x {peer} ({row['requests_per_s']:.0f} against "
        f"{report['peak'][peer]['requests_per_s']:.0f} req/s)" if peer else "", row["vs_best_peer"],
        MIN_RATE_VS_BEST_PEER, at_least=True)
    add(f"req/s at {report['peak_concurrency']} clients >= {MIN_RATE_VS_DIRECT}x direct",
        f"{row['vs_direct']:.2f}x direct ({row['requests_per_s']:.0f} against "
        f"{report['peak']['direct']['requests_per_s']:.0f} req/s)", row["vs_direct"],
        MIN_RATE_VS_DIRECT, at_least=True)
    cpu, split = row["router_cpu_ms"], report["peak"][arm].get("cpu_split_ms_per_request", {})
    add(f"Envoy + picker CPU <= {MAX_ROUTER_CPU_MS} ms per request",
        f"{cpu:.2f} ms" + (" (" + ", ".join(f"{k} {v:.2f}" for k, v in split.items()) + ")" if split else "")
        if cpu is not None else "", cpu, MAX_ROUTER_CPU_MS)
    for q, limit in (("p50", MAX_ADDED_P50_MS), ("p99", MAX_ADDED_P99_MS)):
        pooled = report["latency"]["all"]["added"][arm][f"{q}_ms"]
        median = row[f"added_{q}_ms"]
        add(f"added {q} <= {limit} ms (concurrency {report['concurrency']}, max_tokens 1-4)",
            f"{median:+.2f} ms, the median over rounds of the difference within a round (all rounds pooled: "
            f"{pooled:+.2f})" if pooled is not None and median is not None else "", median, limit)
    ratio = row["engine_cpu_vs_direct"]
    add(f"engine CPU per request within {MAX_ENGINE_CPU_VS_DIRECT - 1:.0%} of direct's",
        f"{row['engine_cpu_ms']:.2f} ms = {ratio:.2f}x direct's {engine_cpu_ms(report, 'direct'):.2f}"
        if ratio is not None else "", ratio, MAX_ENGINE_CPU_VS_DIRECT)
    return out


def format_targets(report: dict) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [f"{'arm':<18}{'req/s':>7}{'x direct':>10}{'x best peer':>13}{'router CPU ms':>15}"
             f"{'engine CPU ms':>15}{'x direct':>10}{'added p50':>11}{'added p99':>11}  (added: median over rounds)"]
    for r in arm_rows(report):
        lines.append(f"{r['arm']:<18}{r['requests_per_s']:>7.0f}{r['vs_direct']:>10.2f}"
                     f"{num(r['vs_best_peer'], '.2f'):>13}{num(r['router_cpu_ms'], '.2f'):>15}"
                     f"{num(r['engine_cpu_ms'], '.2f'):>15}{num(r['engine_cpu_vs_direct'], '.2f'):>10}"
                     f"{num(r['added_p50_ms'], '+.2f'):>11}{num(r['added_p99_ms'], '+.2f'):>11}")
    lines.append(f"issue 22's targets for {GATEWAY}:")
    for t in report.get("targets") or targets(report):
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  {verdict:<13}{t['target']}: {t['figure']}")
    return "\n".join(lines)
