"""/metrics moves as a user expects: tokens counted, latencies observed, and a client that disconnects frees its KV."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("" if not sample.labels else str(sorted(sample.labels.items())))
            values[key] = sample.value
    return values


@pytest.fixture(scope="module")
def base(tiny_server: str) -> str:
    return tiny_server


def test_metrics_count_tokens_and_observe_latencies(base: str) -> None:
    before = scrape(base)
    for names in ("kvfleet_kv_cache_usage", "kvfleet_kv_cache_blocks_total", "kvfleet_num_requests_running",
                  "kvfleet_num_requests_waiting", "kvfleet_num_preemptions_total", "kvfleet_prefix_cache_hits_total"):
        assert names in before
    response = httpx.post(f"{base}/v1/completions", timeout=60,
                          json={"prompt": [9] * 20, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200
    after = scrape(base)
    assert after["kvfleet_generation_tokens_total"] - before["kvfleet_generation_tokens_total"] == 5
    assert after["kvfleet_prompt_tokens_total"] - before["kvfleet_prompt_tokens_total"] == 20
    assert after["kvfleet_time_to_first_token_seconds_count"] == before["kvfleet_time_to_first_token_seconds_count"] + 1
    assert after["kvfleet_e2e_request_latency_seconds_count"] == before["kvfleet_e2e_request_latency_seconds_count"] + 1
    assert after["kvfleet_batch_size_count"] > before["kvfleet_batch_size_count"]


def test_rejections_are_counted_by_reason(base: str) -> None:
    before = scrape(base)
    key = "kvfleet_requests_rejected_total[('reason', 'invalid')]"
    httpx.post(f"{base}/v1/completions", json={"prompt": [1] * 250, "max_tokens": 50}, timeout=30)
    assert scrape(base)[key] == before[key] + 1


def test_disconnect_mid_stream_frees_the_blocks(base: str) -> None:
    start = scrape(base)
    total = start["kvfleet_kv_cache_blocks_total"]
    body = {"prompt": [4] * 60, "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        mid = scrape(base)
        assert mid["kvfleet_num_requests_running"] == 1
        assert mid["kvfleet_kv_cache_blocks_free"] < total
    # the client is gone: the engine aborts the request and frees its blocks within a step
    for _ in range(100):
        now = scrape(base)
        if now["kvfleet_kv_cache_blocks_free"] == total and now["kvfleet_num_requests_running"] == 0:
            generated = now["kvfleet_generation_tokens_total"] - start["kvfleet_generation_tokens_total"]
            assert generated < 150, "the request ran to the end instead of being aborted"
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks not freed after the client left: {now['kvfleet_kv_cache_blocks_free']} of {total}")


def test_unknown_fields_are_counted(base: str) -> None:
    before = scrape(base)["kvfleet_request_ignored_fields_total"]
    response = httpx.post(f"{base}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 1, "brand_new_field": 1, "another_one": "x"})
    assert response.status_code == 200
    assert scrape(base)["kvfleet_request_ignored_fields_total"] == before + 2


def test_disconnect_before_a_plain_response_frees_the_blocks(base: str) -> None:
    start = scrape(base)
    total = start["kvfleet_kv_cache_blocks_total"]
    body = {"prompt": [6] * 40, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        # the client leaves after 0.1 s: a quiet machine generates the 200 tokens in about 0.3 s
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    for _ in range(100):
        now = scrape(base)
        if now["kvfleet_num_requests_running"] == 0 and now["kvfleet_kv_cache_blocks_free"] == total:
            generated = now["kvfleet_generation_tokens_total"] - start["kvfleet_generation_tokens_total"]
            assert generated < 200, "the request ran to the end instead of being aborted"
            return
        time.sleep(0.05)
    raise AssertionError("blocks not freed after the client left a non-streaming request")


def test_metrics_can_be_restricted_to_named_ones_for_frequent_scrapes(base: str) -> None:
    from kvfleet.fleet.load import METRICS_QUERY, parse_engine_load

    text = httpx.get(f"{base}/metrics?{METRICS_QUERY}").text
    names = {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert names == {"kvfleet_kv_cache_usage", "kvfleet_num_requests_waiting", "kvfleet_num_requests_running",
                     "kvfleet_max_num_seqs", "kvfleet_prefill_tokens_pending", "kvfleet_prefill_tokens_per_second",
                     "kvfleet_request_slot_seconds", "kvfleet_decode_tokens_per_second_full_batch"}
    assert parse_engine_load(text).max_num_seqs == 128  # the engine default
    assert len(text) < len(httpx.get(f"{base}/metrics").text) / 5


def test_the_start_up_split_is_exported_once_the_engine_is_ready(base: str) -> None:
    """Where the engine's cold start went (the autoscaler's cold start, measured): every phase, each within the
    process's life, the phases adding up to about the total."""
    values = scrape(base)
    phases = {p: values.get(f"kvfleet_startup_seconds[('phase', '{p}')]")
              for p in ("imports", "tokenizer", "weights", "kv_cache", "warmup", "total")}
    assert all(v is not None and v >= 0 for v in phases.values()), phases
    total = phases.pop("total")
    assert 0 < sum(phases.values()) <= total + 0.5, (phases, total)
    assert phases["imports"] > 0 and phases["weights"] > 0
    assert total < 600
