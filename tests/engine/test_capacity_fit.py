"""The engine's full-batch decode rate (kvfleet_decode_tokens_per_second_full_batch): the fit of step time against
batch size, and the gauge on a real engine's /metrics as the operator reads it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvfleet.engine.capacity_fit import DecodeStepFit, fit_line, full_batch_tokens_per_s
from kvfleet.engine.llm_engine import MIN_MEASURED_PREFILL
from kvfleet.fleet.metrics import DECODE_TOKENS_PER_SECOND_FULL_BATCH
from kvfleet.operator.observe import scrape_pod


def test_the_line_through_step_times_gives_the_full_batch_rate() -> None:
    a, b = 0.010, 0.002  # 10 ms per step plus 2 ms per sequence
    line = fit_line([(n, a + b * n, 1) for n in (1, 2, 4, 8)])
    assert line == pytest.approx((a, b))
    assert full_batch_tokens_per_s(line, 16) == pytest.approx(16 / (a + b * 16))


def test_no_rate_until_two_batch_sizes_and_noise_never_makes_a_full_batch_faster() -> None:
    fit = DecodeStepFit(max_num_seqs=32)
    for _ in range(5):
        fit.add(1, 0.02)
    assert fit.tokens_per_s == 0.0  # one batch size: no line yet
    fit.add(4, 0.018)  # noise: a bigger batch measured faster
    assert fit.tokens_per_s == pytest.approx(32 / fit_line([(1, 0.02, 5), (4, 0.018, 1)])[0])
    assert fit_line([(1, 0.02, 5), (4, 0.018, 1)])[1] == 0.0  # flat, never a negative slope
    fit.add(0, 1.0)
    fit.add(3, float("nan"))
    assert set(fit.step_seconds) == {1, 4}  # empty steps and unmeasured times are ignored


def test_a_line_that_gives_no_positive_time_gives_no_rate() -> None:
    assert full_batch_tokens_per_s((-1.0, 0.001), 16) == 0.0
    assert full_batch_tokens_per_s(None, 16) == 0.0


def test_a_real_engine_exports_the_rate_after_requests_of_several_batch_sizes(tiny_server: str) -> None:
    async def scenario() -> tuple:
        async with httpx.AsyncClient(timeout=60) as http:
            before = await scrape_pod(http, tiny_server)
            # Three requests of different lengths: decode steps of batch 3, then 2, then 1. Each prompt is longer
            # than the shortest prefill the engine measures its rate on, so the rate is measured even when the
            # three arrive in separate steps.
            answers = await asyncio.gather(*(http.post(f"{tiny_server}/v1/completions", json={
                "prompt": [7 + k] * (MIN_MEASURED_PREFILL + 6), "max_tokens": n, "temperature": 0,
                "ignore_eos": True}) for k, n in enumerate((6, 12, 18))))
            after = await scrape_pod(http, tiny_server)
            text = (await http.get(f"{tiny_server}/metrics")).text
        return before, answers, after, text

    before, answers, after, text = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert before.has_metrics and before.decode_tokens_per_s_full_batch is None  # the warm-up: one batch size
    assert f"# TYPE {DECODE_TOKENS_PER_SECOND_FULL_BATCH} gauge" in text
    assert after.max_num_seqs and after.max_num_seqs > 1
    assert after.decode_tokens_per_s_full_batch is not None and after.decode_tokens_per_s_full_batch > 0
    assert after.prefill_tokens_per_s is not None and after.prefill_tokens_per_s > 0
