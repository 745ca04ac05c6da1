"""What the gateway learns of a vLLM engine from its scrapes: its batch capacity, slot time, computed tokens per
request and prefill rate (gateway/engines/learned.py). The real vLLM case is in tests/kvfleet/local/test_vllm_fleet.py
(the gateway shows each engine's --max-num-seqs once it has seen it full)."""

from __future__ import annotations

import pytest

from kvfleet.fleet.load import EngineLoad, RequestTotals, parse_engine_load
from kvfleet.gateway.engines.learned import Learned, filled, learn
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.routing.pick import RoutingContext
from kvfleet.gateway.routing.ttft import EstimatedTTFT


def vllm_text(running: int, waiting: int, finished: int, running_s: float, prefill_s: float, computed: int) -> str:
    """vLLM 0.32's exposition of the samples read (two label sets per histogram: a data-parallel pod's ranks)."""
    lines = [f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0',
             f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0',
             'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.3']
    for name, total in (("request_inference_time_seconds", running_s), ("request_prefill_time_seconds", prefill_s),
                        ("request_prefill_kv_computed_tokens", computed)):
        for rank, share in (("0", 0.75), ("1", 0.25)):
            lines += [f'vllm:{name}_bucket{{engine="{rank}",le="+Inf",model_name="m"}} {finished * share}',
                      f'vllm:{name}_count{{engine="{rank}",model_name="m"}} {finished * share}',
                      f'vllm:{name}_sum{{engine="{rank}",model_name="m"}} {total * share}',
                      f'vllm:{name}_created{{engine="{rank}",model_name="m"}} 1.7e9']
    return "\n".join(lines) + "\n"


def test_vllms_request_totals_are_read_summed_over_its_ranks() -> None:
    load = parse_engine_load(vllm_text(3, 0, 8, 20.0, 2.0, 4000))
    assert load.totals == RequestTotals(8.0, 20.0, 2.0, 4000.0)
    assert load.max_num_seqs is None and load.request_slot_seconds is None  # vLLM says neither


def test_a_kvfleet_engines_own_figures_are_kept_and_nothing_is_learnt() -> None:
    load = EngineLoad(0.2, 2, 4, max_num_seqs=8, request_slot_seconds=1.5)
    assert learn(Learned(), load) == Learned() and filled(load, Learned(batch=3)) is load


def test_the_batch_capacity_is_what_ran_while_requests_waited_and_never_less_than_what_ran_since() -> None:
    known = Learned()
    for running, waiting, batch in ((2, 0, None), (3, 2, 3), (1, 0, 3), (4, 0, 4), (2, 5, 4)):
        known = learn(known, parse_engine_load(vllm_text(running, waiting, 0, 0.0, 0.0, 0)))
        assert known.batch == batch, (running, waiting)


def test_slot_time_tokens_and_prefill_rate_come_from_the_requests_finished_between_scrapes() -> None:
    known = learn(Learned(), parse_engine_load(vllm_text(0, 0, 10, 50.0, 1.0, 2000)))
    assert known.slot_s is None  # one scrape: nothing finished between two yet
    known = learn(known, parse_engine_load(vllm_text(0, 0, 14, 58.0, 1.5, 3600)))
    assert (known.slot_s, known.computed_tokens, known.prefill_rate) == pytest.approx((2.0, 400.0, 3200.0))
    known = learn(known, parse_engine_load(vllm_text(0, 0, 15, 61.0, 1.6, 3700)))  # one more: a moving average
    assert (known.slot_s, known.computed_tokens) == pytest.approx((0.8 * 2.0 + 0.2 * 3.0, 0.8 * 400 + 0.2 * 100))
    restarted = learn(known, parse_engine_load(vllm_text(0, 0, 1, 9.0, 0.1, 50)))
    assert (restarted.slot_s, restarted.totals.finished) == (known.slot_s, 1.0)  # counted from the new totals


def test_a_full_vllm_engine_costs_its_waiting_prefill_and_slot_wait_in_the_ttft_estimate() -> None:
    """Two vLLM engines alike but for their load; before, the estimate saw only this gateway's unseen dispatches,
    so a full batch with requests waiting read as free as an idle engine."""
    pool = EndpointPool()
    pool.set_urls(["http://full", "http://idle"])
    for url, running, waiting in (("http://full", 4, 3), ("http://idle", 1, 0)):
        pool.record_scrape(url, parse_engine_load(vllm_text(4, 1, 10, 30.0, 1.0, 4000)), now=0.0)
        pool.record_scrape(url, parse_engine_load(vllm_text(running, waiting, 12, 36.0, 1.2, 4800)), now=0.1)
    snaps = {e.url: e for e in pool.snapshots(now=0.1)}
    full, idle = snaps["http://full"], snaps["http://idle"]
    assert (full.max_num_seqs, full.slot_seconds, full.prefill_tokens_pending) == (4, 3.0, 1200)
    assert full.prefill_rate == pytest.approx(4000.0)
    ttft, request = EstimatedTTFT(), RoutingContext(num_tokens=400)
    # 1200 waiting tokens + 400 of its own at 4,000 tokens/s, and the 4th request past a full batch of 4 waits for
    # four slots to free at one per 3 s / 4
    assert ttft.estimate(full, request, 4000.0) == pytest.approx(1600 / 4000 + 4 * 3.0 / 4)
    assert ttft.estimate(idle, request, 4000.0) == pytest.approx(400 / 4000)
