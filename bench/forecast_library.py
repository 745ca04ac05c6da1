"""The library baseline for bench/forecast_demand.py, run in a venv with statsmodels: reads {"ahead": H, "series":
{class: [values]}} on stdin, writes {class: [forecast made at each step for H steps later]}: statsmodels' Holt
(additive trend, parameters fitted by its optimizer) on the last 80 steps (20 minutes) at every step."""

import json
import sys
import warnings

from statsmodels.tsa.holtwinters import Holt

WINDOW = 80


def forecasts(xs: list[float], ahead: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        history = xs[max(0, i - WINDOW + 1):i + 1]
        if len(history) < 10 or max(history) == min(history):
            out.append(history[-1])
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit = Holt(history, initialization_method="estimated").fit()
        out.append(max(0.0, float(fit.forecast(ahead)[-1])))
    return out


if __name__ == "__main__":
    request = json.load(sys.stdin)
    json.dump({c: forecasts(xs, request["ahead"]) for c, xs in request["series"].items()}, sys.stdout)
