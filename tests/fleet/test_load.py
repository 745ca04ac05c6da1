"""The gateway reads an engine's load from /metrics: a real kvfleet engine's text, or vLLM's names."""

from __future__ import annotations

import httpx
import pytest

from kvfleet.fleet.load import MetricsParseError, parse_engine_load

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
"""


def test_reads_a_real_kvfleet_engine(tiny_server: str) -> None:
    load = parse_engine_load(httpx.get(f"{tiny_server}/metrics", timeout=10).text)
    assert load.num_running == 0 and load.num_waiting == 0
    assert 0.0 <= load.kv_cache_usage < 0.5


def test_reads_vllm_names() -> None:
    load = parse_engine_load(VLLM_TEXT)
    assert (load.kv_cache_usage, load.num_waiting, load.num_running) == (0.42, 7, 3)


def test_reads_older_vllm_gpu_cache_name() -> None:
    text = VLLM_TEXT.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_engine_load(text).kv_cache_usage == 0.42


def test_missing_signal_and_garbage_are_clear_errors() -> None:
    with pytest.raises(MetricsParseError, match="no kv_cache_usage metric; expected one of kvfleet_kv_cache_usage"):
        parse_engine_load("up 1\n")
    with pytest.raises(MetricsParseError, match="no kv_cache_usage metric"):
        parse_engine_load("<html>this is { not prometheus</html>\n")
    with pytest.raises(MetricsParseError, match="cannot read the value"):
        parse_engine_load("kvfleet_kv_cache_usage lots\n")
