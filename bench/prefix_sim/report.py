"""The figures of a run, per policy: TTFT quantiles, throughput, fleet prefix hit rate (and its ratio to the
oracle's), herding index, the index's memory per replica, the KV events each replica absorbs; then the JSON, the
table and the chart under bench/results."""

from __future__ import annotations

import json
import math
import sys
from collections import deque
from pathlib import Path

from bench.plotting import finish, pyplot
from bench.prefix_sim.gateway import ORACLES
from bench.prefix_sim.model import Run

HERDING_WINDOW_S = 0.1


def summarize(run: Run, warmup_s: float, duration_s: float) -> dict:
    """Figures over the requests that arrived in [warmup_s, duration_s): the cache has filled by then."""
    measured = [j for j in run.jobs if warmup_s <= j.arrival.at < duration_s]
    ttfts = sorted(j.first_token - j.arrival.at if j.first_token is not None else math.inf for j in measured)
    window = duration_s - warmup_s
    finished = [j for j in run.jobs if j.finished is not None and warmup_s <= j.finished < duration_s]
    prompt = sum(j.seq.num_prompt_tokens for j in measured if j.first_token is not None)
    finite = [t for t in ttfts if math.isfinite(t)]
    return {
        "requests": len(measured),
        "first_of_tenant_share": sum(j.arrival.first_of_tenant for j in measured) / max(1, len(measured)),
        "ttft_mean_s": sum(finite) / len(finite) if finite else None,
        "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p90_s": _quantile(ttfts, 0.9), "ttft_p99_s": _quantile(ttfts, 0.99),
        "no_first_token": len(ttfts) - len(finite),
        "throughput_rps": len(finished) / window,
        "output_tokens_per_s": sum(j.arrival.output_tokens for j in finished) / window,
        "prefix_hit_rate": sum(j.hit_tokens for j in measured if j.first_token is not None) / max(1, prompt),
        **dict(zip(("herding_index", "herding_vs_even"), herding_index(run, warmup_s, duration_s), strict=True)),
        **index_figures(run, window=run.end_s),
    }


def herding_index(run: Run, start: float, end: float) -> tuple[float | None, float | None]:
    """Mean over 100 ms windows (those with any arrival) of max / mean per-engine arrivals, and of max / the most
    an even spread would give (ceil(arrivals / engines): 1.0 is as even as the arrivals allow)."""
    windows = max(1, int((end - start) / HERDING_WINDOW_S))
    counts = [[0] * len(run.engines) for _ in range(windows)]
    for job in run.jobs:
        if job.engine >= 0 and start <= job.dispatched_at < end:
            counts[min(windows - 1, int((job.dispatched_at - start) / HERDING_WINDOW_S))][job.engine] += 1
    busy = [c for c in counts if sum(c)]
    if not busy:
        return None, None
    ratios = [max(c) * len(c) / sum(c) for c in busy]
    excess = [max(c) / -(-sum(c) // len(c)) for c in busy]
    return sum(ratios) / len(busy), sum(excess) / len(busy)


def index_figures(run: Run, window: float) -> dict:
    """The prefix index of replica 0 at the end (bytes by a deep sizeof, entries) and the KV events every replica
    absorbs per second (each replica subscribes to every engine)."""
    router = run.routers[0]
    prefix = getattr(router, "prefix", None)
    out: dict = {"index_bytes_per_replica": None, "index_entries_per_replica": None,
                 "kv_events_per_s_per_replica": None, "kv_blocks_per_s_per_replica": None}
    if prefix is None:
        return out
    if prefix.tokenize is not None:
        index = prefix.index
        out["index_entries_per_replica"] = sum(index.size(url) for url in index.engines())
        out["index_bytes_per_replica"] = deep_sizeof((index._engines, index._holders, index.block_sizes))
        events = sum(e.events_published for e in run.engines)
        blocks = sum(e.blocks_published for e in run.engines)
        out["kv_events_per_s_per_replica"] = events / window
        out["kv_blocks_per_s_per_replica"] = blocks / window
    else:
        out["index_entries_per_replica"] = len(prefix.approx._owner)
        out["index_bytes_per_replica"] = deep_sizeof(prefix.approx._owner)
    return out


def deep_sizeof(root: object) -> int:
    """Bytes held by root and everything it references (each object once; shared strings counted once)."""
    seen: set[int] = set()
    total, stack = 0, deque([root])
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.append(vars(obj))
    return total


def relate(runs: dict[str, dict]) -> None:
    """Each policy's hit rate as a share of the oracle's (the estimated-TTFT oracle, as the issue's target reads),
    and of the best oracle's."""
    oracle = runs.get("oracle", {}).get("prefix_hit_rate")
    best = max((runs[name]["prefix_hit_rate"] for name in ORACLES if name in runs), default=None)
    for figures in runs.values():
        figures["hit_rate_vs_oracle"] = figures["prefix_hit_rate"] / oracle if oracle else None
        figures["hit_rate_vs_best_oracle"] = figures["prefix_hit_rate"] / best if best else None


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    value = ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return value if math.isfinite(value) else None


def table(report: dict) -> str:
    head = ("| load (req/s) | policy | TTFT mean | p50 | p90 | p99 | served req/s | hit rate | vs oracle (best) | "
            "herding (vs even) | index bytes/replica | entries | KV events/s/replica | new tenants |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for point in report["sweep"]:
        for name, f in point["runs"].items():
            rows.append(f"| {point['load']:.2f} ({point['rate_rps']:.1f}) | {name} | {_s(f['ttft_mean_s'])} | "
                        f"{_s(f['ttft_p50_s'])} | "
                        f"{_s(f['ttft_p90_s'])} | {_s(f['ttft_p99_s'])} | {f['throughput_rps']:.1f} | "
                        f"{f['prefix_hit_rate']:.1%} | "
                        f"{_r(f['hit_rate_vs_oracle'])} ({_r(f['hit_rate_vs_best_oracle'])}) | "
                        f"{_r(f['herding_index'])} ({_r(f['herding_vs_even'])}) | "
                        f"{_n(f['index_bytes_per_replica'])} | {_n(f['index_entries_per_replica'])} | "
                        f"{_n(f['kv_events_per_s_per_replica'])} | {f['first_of_tenant_share']:.1%} |")
    return "\n".join(rows)


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s"


def _r(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _n(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def write(report: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    chart(report, out / f"{name}.png")


def chart(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    loads = [p["load"] for p in report["sweep"]]
    for name in report["sweep"][0]["runs"]:
        runs = [p["runs"][name] for p in report["sweep"]]
        axes[0].plot(loads, [r["ttft_p90_s"] or math.nan for r in runs], marker="o", label=name)
        axes[1].plot(loads, [r["prefix_hit_rate"] for r in runs], marker="o", label=name)
        axes[2].plot(loads, [r["throughput_rps"] for r in runs], marker="o", label=name)
    axes[0].set(yscale="log", xlabel="load (share of fleet capacity)",
                ylabel="p90 TTFT (s; gap: >10% never started)")
    axes[1].set(xlabel="load (share of fleet capacity)", ylabel="fleet prefix hit rate (tokens)")
    axes[2].set(xlabel="load (share of fleet capacity)", ylabel="throughput (requests/s)")
    fleet = report["fleet"]
    fig.suptitle(f"prefix-aware routing, simulated: {fleet['engines']} engines, {fleet['replicas']} gateway replicas, "
                 f"{report['workload']['tenants']} tenants")
    print(f"chart: {finish(fig, path, axes)}")
