"""The shared-prefix routing benchmark's figures: per arm and load, TTFT, throughput, engine shares and the engines'
own prefix hit rates; ratios against least-request and sglang-router's cache_aware; the table and the chart."""

from __future__ import annotations

import math
from pathlib import Path

from bench.plotting import finish, pyplot
from bench.prefix_workload import PlannedChat
from kvfleet.bench_report import percentile
from kvfleet.loadgen import RequestRecord

LOAD_ONLY, PEER, STRONGEST_PEER = "least-request", "sglang-router", "smg"
# The issue's targets, for arms that are kvfleet's own: ratio name -> (most allowed, which is better).
TARGETS = {"p90_ttft_vs_least_request": 0.3, "mean_ttft_vs_sglang_router": 0.8}
# On vLLM engines (issue 36): against the better of the cache-aware peers that vLLM users run, each on its home turf.
VLLM_PEERS = ("smg", "vllm-router-kv")
VLLM_TARGETS = {"mean_ttft_vs_better_peer": 0.85, "p90_ttft_vs_least_request": 0.5, "hit_rate_vs_best_peer": 1.0}
KNEE_TARGET = 1.5  # throughput at the knee ÷ least-request's, at least


def summarize_arm(records: list[RequestRecord], deltas: dict[str, dict], plan: list[PlannedChat], warmup: int,
                  engine_names: dict[str, str], skip_firsts: bool = False) -> dict:
    """Figures over the measured requests (index >= warmup; with skip_firsts, not the first of their tenant or
    conversation: a conversation's later turns); counters over the same stretch."""
    measured = [r for r in records if r.index >= warmup and not (skip_firsts and plan[r.index].first_of_key)]
    ok = [r for r in measured if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    span = (max((r.sent_at + r.e2e_s for r in measured), default=0.0)
            - min((r.sent_at for r in measured), default=0.0))
    firsts = sum(plan[r.index].first_of_key for r in measured)
    engines = {engine_names.get(url, url): _engine(d) for url, d in deltas.items()}
    served = sum(e["requests"] for e in engines.values()) or 1
    for e in engines.values():
        e["share"] = e["requests"] / served
    hits, queries = (sum(d[k] for d in deltas.values()) for k in ("hits", "queries"))
    engine_ttft_s, engine_ttfts = (sum(d.get(k, 0.0) for d in deltas.values())
                                   for k in ("engine_ttft_sum", "engine_ttft_count"))
    errors: dict[str, int] = {}
    for r in measured:
        if not r.ok:
            key = f"{r.status}: {(r.error or '')[:80]}"
            errors[key] = errors.get(key, 0) + 1
    return {"count": len(measured), "ok": len(ok), "errors": errors,
            "ttft_s": _stats(ttfts), "e2e_s": _stats(e2es),
            "completed_per_s": len(ok) / span if span > 0 else None,
            "first_of_key_share": firsts / len(measured) if measured else None,
            "fleet_hit_rate": hits / queries if queries else None, "engines": engines,
            # the engines' own mean TTFT over the same requests (from arrival there): the client's mean less this is
            # what the router added (its decision, its queue, its proxying)
            "engine_ttft_mean_s": engine_ttft_s / engine_ttfts if engine_ttfts else None}


def _engine(delta: dict) -> dict:
    return {"requests": int(delta["requests"]), "prompt_tokens": int(delta["prompt_tokens"]),
            "hit_rate": delta["hits"] / delta["queries"] if delta["queries"] else None,
            "engine_ttft_sum_s": delta.get("engine_ttft_sum", 0.0),
            "engine_ttft_count": int(delta.get("engine_ttft_count", 0))}


def _stats(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values) if values else None,
            **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(arms: dict[str, dict]) -> dict[str, dict]:
    """Per arm that ran: p90 and mean TTFT and throughput against least-request, mean TTFT against sglang-router."""
    lr, peer = arms.get(LOAD_ONLY, {}).get("summary"), arms.get(PEER, {}).get("summary")
    strongest = arms.get(STRONGEST_PEER, {}).get("summary")
    vllm_peers = [arms[n]["summary"] for n in VLLM_PEERS if (arms.get(n) or {}).get("summary")]
    better_mean = min((p["ttft_s"]["mean"] for p in vllm_peers if p["ttft_s"]["mean"] is not None), default=None)
    best_hits = max((p["fleet_hit_rate"] for p in vllm_peers if p["fleet_hit_rate"] is not None), default=None)
    out = {}
    for name, arm in arms.items():
        s = arm.get("summary")
        if s is None:
            continue
        out[name] = {
            "p90_ttft_vs_least_request": lr and _div(s["ttft_s"]["p90"], lr["ttft_s"]["p90"]),
            "mean_ttft_vs_least_request": lr and _div(s["ttft_s"]["mean"], lr["ttft_s"]["mean"]),
            "throughput_vs_least_request": lr and _div(s["completed_per_s"], lr["completed_per_s"]),
            "mean_ttft_vs_sglang_router": peer and _div(s["ttft_s"]["mean"], peer["ttft_s"]["mean"]),
            "mean_ttft_vs_smg": strongest and _div(s["ttft_s"]["mean"], strongest["ttft_s"]["mean"]),
            "mean_ttft_vs_better_peer": _div(s["ttft_s"]["mean"], better_mean),
            "hit_rate_vs_best_peer": _div(s["fleet_hit_rate"], best_hits),
        }
    return out


def pooled(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Several rounds of the same arms on a noisy machine: per arm, each ratio's geometric mean over the rounds (a
    ratio is taken within one round, where the arms shared the machine's state), and each figure's mean."""
    per_round = [ratios(arms) for arms in rounds]
    out: dict[str, dict] = {}
    for name in dict.fromkeys(n for arms in rounds for n in arms):
        summaries = [arms[name]["summary"] for arms in rounds if (arms.get(name) or {}).get("summary")]
        if not summaries:
            continue
        row: dict = {"rounds": len(summaries)}
        figures = {"ttft_mean_s": lambda s: s["ttft_s"]["mean"], "ttft_p90_s": lambda s: s["ttft_s"]["p90"],
                   "hit_rate": lambda s: s["fleet_hit_rate"], "completed_per_s": lambda s: s["completed_per_s"]}
        for figure, pick in figures.items():
            values = [v for v in map(pick, summaries) if v is not None]
            row[figure] = sum(values) / len(values) if values else None
        for ratio in ("p90_ttft_vs_least_request", "mean_ttft_vs_least_request", "mean_ttft_vs_sglang_router",
                      "mean_ttft_vs_smg"):
            values = [r[name][ratio] for r in per_round if name in r and r[name].get(ratio)]
            row[ratio] = math.prod(values) ** (1 / len(values)) if values else None
            row[f"{ratio}_each"] = values
        out[name] = row
    return out


def knee_throughput(runs: dict[str, dict]) -> dict[str, float | None]:
    """Per arm, the most completed req/s over the sweep's loads (its throughput at the knee)."""
    best: dict[str, float | None] = {}
    for arms in runs.values():
        for name, arm in arms.items():
            value = (arm.get("summary") or {}).get("completed_per_s")
            if value is not None and (best.get(name) is None or value > best[name]):
                best[name] = value
            best.setdefault(name, None)
    return best


def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    lines = [f"\n{report['command']}", report["setup"]]
    for load, arms in report["runs"].items():
        lines.append(f"\nload {load} ({report['rates'][load.split(' round ')[0]]:.2f} req/s offered):")
        lines.append(f"{'arm':<22} {'ok/n':>8} {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'p99':>7} {'e2e p90':>8} "
                     f"{'req/s':>6} {'hit%':>5} {'firsts':>6} {'CPU ms/r':>8}  engines: share (hit%)  | "
                     "p90/LR mean/LR mean/sglang")
        table_ratios = report["ratios"][load]
        for name, arm in arms.items():
            s = arm.get("summary")
            if s is None:
                lines.append(f"{name:<22} did not run: {arm.get('error', '?')[:150]}")
                continue
            t, r = s["ttft_s"], table_ratios.get(name, {})
            share = " ".join(f"{e['share']:.0%}({_f(e['hit_rate'] and 100 * e['hit_rate'], '.0f')})"
                             for e in s["engines"].values())
            lines.append(
                f"{name:<22} {s['ok']:>4}/{s['count']:<3} {_f(t['mean']):>9} {_f(t['p50']):>7} {_f(t['p90']):>7} "
                f"{_f(t['p99']):>7} {_f(s['e2e_s']['p90']):>8} {_f(s['completed_per_s'], '.2f'):>6} "
                f"{_f(s['fleet_hit_rate'] and 100 * s['fleet_hit_rate'], '.1f'):>5} "
                f"{_f(s['first_of_key_share'] and 100 * s['first_of_key_share'], '.1f'):>5}% "
                f"{_f(s.get('router_cpu_ms_per_request'), '.1f'):>8}  {share:<21} | "
                f"{_f(r.get('p90_ttft_vs_least_request'), '.2f')} {_f(r.get('mean_ttft_vs_least_request'), '.2f')} "
                f"{_f(r.get('mean_ttft_vs_sglang_router'), '.2f')}")
            if s["errors"]:
                lines.append(f"{'':<22} errors: {s['errors']}")
    firsts = [a["summary"]["first_of_key_share"] for arms in report["runs"].values() for a in arms.values()
              if a.get("summary") and a["summary"]["first_of_key_share"] is not None]
    worst = max(firsts, default=0.0)
    lines.append(f"\nfirst requests of a tenant/conversation among measured requests: at most {worst:.1%} "
                 f"({'under' if worst < 0.05 else 'NOT under'} the 5% the targets need)")
    for load, rows in report.get("pooled", {}).items():
        lines.append(f"\nload {load}, {max(r['rounds'] for r in rows.values())} rounds pooled (figures: mean over "
                     "rounds; ratios: geometric mean of each round's, each round's in brackets):")
        for name, r in rows.items():
            each = {k: "/".join(_f(v, ".2f") for v in r[f"{k}_each"]) for k in
                    ("p90_ttft_vs_least_request", "mean_ttft_vs_sglang_router", "mean_ttft_vs_smg")}
            lines.append(
                f"{name:<22} mean {_f(r['ttft_mean_s'])} p90 {_f(r['ttft_p90_s'])} hit "
                f"{_f(r['hit_rate'] and 100 * r['hit_rate'], '.1f')}% | p90/LR "
                f"{_f(r['p90_ttft_vs_least_request'], '.2f')} [{each['p90_ttft_vs_least_request']}] mean/sglang "
                f"{_f(r['mean_ttft_vs_sglang_router'], '.2f')} [{each['mean_ttft_vs_sglang_router']}] mean/smg "
                f"{_f(r['mean_ttft_vs_smg'], '.2f')} [{each['mean_ttft_vs_smg']}]")
    knee = report["knee_requests_per_s"]
    lines.append("throughput at the knee (most completed req/s over the loads): " + ", ".join(
        f"{n} {_f(v, '.2f')} ({_f(_div(v, knee.get(LOAD_ONLY)), '.2f')}x LR)" for n, v in knee.items()))
    for load, by_arm in report["ratios"].items():
        if report.get("args", {}).get("runtime") != "vllm":
            break
        for name, r in by_arm.items():
            if name.startswith(("kvfleet", "estimated", "prefix-affinity")):
                lines.append(f"{load} {name} against the vLLM targets: mean TTFT / better of smg and vllm-router-kv "
                             f"{_f(r['mean_ttft_vs_better_peer'], '.2f')} (<= 0.85), p90 TTFT / least-request "
                             f"{_f(r['p90_ttft_vs_least_request'], '.2f')} (<= 0.5), hit rate / best peer's "
                             f"{_f(r['hit_rate_vs_best_peer'], '.2f')} (>= 1)")
    lines.append(f"targets at 80% load for kvfleet's arms: p90 TTFT <= {TARGETS['p90_ttft_vs_least_request']}x "
                 f"least-request, mean TTFT <= {TARGETS['mean_ttft_vs_sglang_router']}x sglang-router cache_aware; "
                 f"knee throughput >= {KNEE_TARGET}x least-request")
    return "\n".join(lines)


def chart(report: dict, path: Path) -> Path | None:
    """TTFT p90, mean TTFT and the fleet hit rate per arm: bars at one load, lines against the offered rate."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    names = list(dict.fromkeys(n for arms in report["runs"].values() for n in arms))
    one_load = len(report["rates"]) == 1  # bars (the mean over rounds, if several); else lines over the loads
    figures = {"TTFT p90 (s, lower is better)": lambda s: s["ttft_s"]["p90"],
               "mean TTFT (s, lower is better)": lambda s: s["ttft_s"]["mean"],
               "fleet prefix hit rate (engines' counters)": lambda s: s["fleet_hit_rate"]}
    for i, name in enumerate(names):
        points = [(report["rates"][key.split(" round ")[0]], arms[name]["summary"])
                  for key, arms in report["runs"].items() if arms.get(name, {}).get("summary")]
        if not points:
            continue
        for ax, value in zip(axes, figures.values(), strict=True):
            ys = [value(s) or 0 for _, s in points]
            if one_load:
                ax.bar_label(ax.bar([i], [sum(ys) / len(ys)], label=name, color=f"C{i}"), fmt="%.2f", fontsize=7)
            else:
                ax.plot([p[0] for p in points], ys, marker="o", label=name, color=f"C{i}")
    for ax, title in zip(axes, figures, strict=True):
        ax.set(title=title, ylim=(0, None))
        if one_load:
            ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        else:
            ax.set_xlabel("offered req/s")
    rates = ", ".join(f"{key} ({rate:.2f} req/s)" for key, rate in report["rates"].items())
    fig.suptitle(f"{report['setup']}; load {rates}", fontsize=9)
    return finish(fig, path, axes, legend_fontsize=None if one_load else 8)
