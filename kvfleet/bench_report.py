"""What `kvfleet bench` reports: the summary (by priority class and overall), a JSON file and a PNG chart."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from kvfleet.fleet.headers import ENGINE as ENGINE_HEADER
from kvfleet.fleet.priority import Priority
from kvfleet.loadgen import LoadSpec, RequestRecord

CLASS_COLORS = {"critical": "tab:red", "standard": "tab:blue", "sheddable": "tab:green"}
REJECTION_MARKERS = {429: ("x", "429"), 503: ("v", "503")}  # status → (marker, label)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics, as numpy does."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _group_summary(records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    statuses = Counter(str(r.status) if r.status is not None else "error" for r in records)
    tokens = sum(r.output_tokens for r in ok)

    def quantiles(values: list[float]) -> dict:
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

    return {"count": len(records), "ok": len(ok), "by_status": dict(sorted(statuses.items())),
            "ttft_s": quantiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "e2e_s": quantiles([r.e2e_s for r in ok if r.e2e_s is not None]),
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration if duration > 0 else None,
            "requests_per_s": len(records) / duration if duration > 0 else None,
            "engines": dict(Counter(r.engine for r in records if r.engine).most_common())}


def summarize(records: list[RequestRecord]) -> dict:
    """Counts, statuses, TTFT/e2e percentiles over successful requests and throughput, overall and by class.
    Rates divide by the whole run (first send to last finish), so the classes' rates add up to the overall one."""
    duration = max((r.sent_at + (r.e2e_s or 0.0) for r in records), default=0.0)
    classes = [p.value for p in Priority if any(r.priority == p.value for r in records)]
    return {"duration_s": duration, "overall": _group_summary(records, duration),
            "by_class": {c: _group_summary([r for r in records if r.priority == c], duration) for c in classes}}


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_summary(summary: dict) -> str:
    """A plain-text table: one row per class and one for all requests, then the engines that served."""
    header = (f"{'class':<10} {'count':>5} {'ok':>5}  {'statuses':<24} {'TTFT p50/p90/p99 s':<20} "
              f"{'e2e p50/p90/p99 s':<20} {'out tok/s':>9} {'req/s':>6}")
    rows = [header]
    for name, group in [*summary["by_class"].items(), ("all", summary["overall"])]:
        statuses = " ".join(f"{code}:{n}" for code, n in group["by_status"].items())
        ttft = "/".join(_fmt(group["ttft_s"][p]) for p in ("p50", "p90", "p99"))
        e2e = "/".join(_fmt(group["e2e_s"][p]) for p in ("p50", "p90", "p99"))
        rows.append(f"{name:<10} {group['count']:>5} {group['ok']:>5}  {statuses:<24} {ttft:<20} {e2e:<20} "
                    f"{_fmt(group['output_tokens_per_s'], '.1f'):>9} {_fmt(group['requests_per_s'], '.2f'):>6}")
    engines = summary["overall"]["engines"]
    served = ", ".join(f"{url}: {n}" for url, n in engines.items()) or f"not named (no {ENGINE_HEADER} header)"
    rows.append(f"duration {summary['duration_s']:.2f} s; engines: {served}")
    return "\n".join(rows)


def write_report(spec: LoadSpec, records: list[RequestRecord], summary: dict, out_dir: Path) -> Path:
    """`<out_dir>/bench-<timestamp>.json` with the spec (no API key), the summary and every record; its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = {"spec": spec.public(), "summary": summary, "records": [asdict(r) for r in records]}
    path.write_text(json.dumps(report, indent=2))
    return path


def write_chart(json_path: Path) -> Path | None:
    """The PNG beside a report: TTFT over send time by class (rejections marked), and the latency CDFs.
    None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no chart written")
        return None
    report = json.loads(json_path.read_text())
    records, spec = report["records"], report["spec"]
    fig, (timeline, cdf) = plt.subplots(1, 2, figsize=(13, 5))
    for name, color in CLASS_COLORS.items():
        mine = [r for r in records if r["priority"] == name]
        ok = [r for r in mine if r["status"] == 200 and r["error"] is None and r["ttft_s"] is not None]
        if ok:
            timeline.scatter([r["sent_at"] for r in ok], [r["ttft_s"] for r in ok], s=14, color=color, label=name)
            for key, style in (("ttft_s", "-"), ("e2e_s", "--")):
                values = sorted(r[key] for r in ok)
                cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], style, color=color,
                         where="post", label=f"{name} {key[:-2].upper()}")
        for status, (marker, label) in REJECTION_MARKERS.items():
            hit = [r for r in mine if r["status"] == status]
            if hit:
                timeline.scatter([r["sent_at"] for r in hit], [r["e2e_s"] for r in hit], marker=marker, s=30,
                                 color=color, label=f"{name} {label} (time to answer)")
    failed = [r for r in records if r["status"] not in (200, *REJECTION_MARKERS) or
              (r["status"] == 200 and r["error"] is not None)]
    if failed:
        timeline.scatter([r["sent_at"] for r in failed], [r["e2e_s"] for r in failed], marker="*", s=40,
                         color="black", label="other failures")
    timeline.set(xlabel="sent at (s from start)", ylabel="TTFT, or time to answer for rejections (s)",
                 title="TTFT by send time")
    cdf.set(xlabel="latency (s)", ylabel="fraction of successful requests",
            title="latency CDF (TTFT solid, e2e dashed)")
    for ax in (timeline, cdf):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ok_total = report["summary"]["overall"]["ok"]
    pace = "all at once" if spec["rate"] in ("inf", 0) else f"at {spec['rate']} req/s"
    fig.suptitle(f"kvfleet bench: {spec['url']} {spec['endpoint']}, {len(records)} requests {pace}, {ok_total} ok")
    fig.tight_layout()
    path = json_path.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
