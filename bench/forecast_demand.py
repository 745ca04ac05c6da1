"""How well each short-horizon forecaster predicts a class's demand one cold start ahead (issue 40, item 3): on the
held-out traces (kvfleet/autoscale_replay/held_out.py, seeds 101 and 202), each class's work (pods at a full batch,
the planner's unit) over 15-second steps, forecast 45 s ahead (a 30 s cold start + one 15 s period) by

- naive: the last step's demand;
- ls-trend: the last step + the rising least-squares slope over 5 minutes (the planner's forecast before this);
- holt: kvfleet's Holt smoothing (operator/forecast.py; alpha and beta tuned on the bundled workloads' seeds 0-9);
- statsmodels-holt: statsmodels' Holt (ExponentialSmoothing, additive trend) fitted afresh at every step on the last
  20 minutes, in its own venv (--statsmodels-python), the library baseline.

Reports per class the relative error (mean |forecast - actual| / mean actual) and the under-forecast share
(forecast below 0.8 × actual), over every trace. Deterministic.

    python -m bench.forecast_demand --statsmodels-python ~/.cache/kvfleet/runtimes/statsmodels-0.15.0/bin/python \
        --json docs/benchmarks/forecast_demand.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvfleet.autoscale_replay.engine_model import EngineModel
from kvfleet.autoscale_replay.held_out import HELD_OUT
from kvfleet.autoscale_replay.trace import Trace
from kvfleet.autoscale_replay.workloads import DEVELOPED
from kvfleet.fleet.priority import Priority
from kvfleet.operator.forecast import Holt

STEP_S, AHEAD_STEPS = 15, 3  # 45 s ahead
SEEDS = (101, 202)
CLASSES = (Priority.CRITICAL, Priority.STANDARD)
LIBRARY = Path(__file__).with_name("forecast_library.py")


def series(trace: Trace) -> dict[Priority, list[float]]:
    """Per class, pods of work at a full batch in each 15-second step."""
    engine = EngineModel()
    decode = engine.decode_tokens_per_s_full_batch
    steps = trace.duration_s // STEP_S
    out = {p: [0.0] * steps for p in Priority}
    for r in trace.rows:
        k = int(r.t // STEP_S)
        if k < steps:
            out[r.priority][k] += (r.prompt_tokens / engine.prefill_tokens_per_s + r.output_tokens / decode) / STEP_S
    return out


def _trend(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of the samples (work/s per second); 0 with fewer than three."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mw = sum(w for _, w in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if var == 0 else sum((t - mt) * (w - mw) for t, w in samples) / var


def naive(xs: list[float]) -> list[float]:
    return list(xs)


def ls_trend(xs: list[float]) -> list[float]:
    span = 300 // STEP_S
    out = []
    for i, x in enumerate(xs):
        window = [(k * STEP_S, xs[k]) for k in range(max(0, i - span + 1), i + 1)]
        out.append(x + max(0.0, _trend(window)) * AHEAD_STEPS * STEP_S)
    return out


def holt(xs: list[float], alpha: float | None = None, beta: float | None = None) -> list[float]:
    import kvfleet.operator.forecast as f

    saved = f.ALPHA, f.BETA
    f.ALPHA, f.BETA = alpha if alpha is not None else saved[0], beta if beta is not None else saved[1]
    try:
        model, out = Holt(), []
        for i, x in enumerate(xs):
            model.update(i * STEP_S, x)
            out.append(model.forecast(AHEAD_STEPS * STEP_S))
        return out
    finally:
        f.ALPHA, f.BETA = saved


def score(xs: list[float], forecasts: list[float]) -> dict:
    pairs = [(forecasts[i], xs[i + AHEAD_STEPS]) for i in range(len(xs) - AHEAD_STEPS)]
    actual = sum(a for _, a in pairs)
    return {"abs_error": sum(abs(f - a) for f, a in pairs), "actual": actual, "n": len(pairs),
            "under": sum(1 for f, a in pairs if a > 0 and f < 0.8 * a)}


def tune(traces: list[Trace]) -> tuple[float, float]:
    """alpha and beta of the least relative error over the developed workloads (seeds 0-9), both classes."""
    data = [series(t) for t in traces]
    best = None
    for alpha in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        for beta in (0.05, 0.1, 0.2, 0.3, 0.5):
            err = act = 0.0
            for s in data:
                for p in CLASSES:
                    sc = score(s[p], holt(s[p], alpha, beta))
                    err, act = err + sc["abs_error"], act + sc["actual"]
            if best is None or err / act < best[0]:
                best = (err / act, alpha, beta)
    return best[1], best[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--statsmodels-python", help="a Python with statsmodels (the library baseline; left out without)")
    p.add_argument("--tune", action="store_true", help="print Holt's alpha and beta tuned on the developed workloads")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.tune:
        print("tuned on seeds 0-9 of the developed workloads: alpha, beta =",
              tune([make(s) for make in DEVELOPED.values() for s in range(10)]))
    totals: dict[str, dict[str, dict]] = {}
    per_trace: dict[str, dict] = {}
    started = time.monotonic()
    for name, make in HELD_OUT.items():
        for seed in SEEDS:
            s = series(make(seed))
            found = {"naive": {p: naive(s[p]) for p in CLASSES}, "ls-trend": {p: ls_trend(s[p]) for p in CLASSES},
                     "holt": {p: holt(s[p]) for p in CLASSES}}
            if args.statsmodels_python:
                request = {"ahead": AHEAD_STEPS, "series": {p.value: s[p] for p in CLASSES}}
                answer = subprocess.run([args.statsmodels_python, str(LIBRARY)], input=json.dumps(request),
                                        capture_output=True, text=True, check=True)
                found["statsmodels-holt"] = {p: json.loads(answer.stdout)[p.value] for p in CLASSES}
            trace = f"{name}/s{seed}"
            per_trace[trace] = {}
            for model, by_class in found.items():
                for p, forecasts in by_class.items():
                    sc = score(s[p], forecasts)
                    per_trace[trace].setdefault(model, {})[p.value] = round(sc["abs_error"] / max(sc["actual"], 1e-9),
                                                                           3)
                    t = totals.setdefault(model, {}).setdefault(p.value, {"abs_error": 0, "actual": 0, "n": 0,
                                                                           "under": 0})
                    for k in t:
                        t[k] += sc[k]
    summary = {model: {c: {"relative_error": round(t["abs_error"] / t["actual"], 3),
                           "under_forecast": round(t["under"] / t["n"], 3)} for c, t in by_class.items()}
               for model, by_class in totals.items()}
    for model, by_class in summary.items():
        print(f"{model:<17} " + "  ".join(f"{c}: error {v['relative_error']:.3f}, under {v['under_forecast']:.3f}"
                                          for c, v in by_class.items()))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        command = " ".join(["python -m bench.forecast_demand", *(argv or sys.argv[1:])])
        args.json.write_text(json.dumps({"command": command, "summary": summary,
                                         "per_trace_relative_error": per_trace}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
