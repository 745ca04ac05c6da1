"""Requests and configurations the engine cannot take are refused up front, with a message that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.kv_capacity import KVCacheTooSmallError, plan_kv_cache
from kvfleet.engine.llm_engine import RequestError
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import QueueFullError
from tests.conftest import make_engine


def test_prompt_plus_max_tokens_beyond_context_is_rejected_with_the_counts(tiny_engine) -> None:
    with pytest.raises(RequestError) as err:
        tiny_engine.add_request("r", [7] * 200, SamplingParams(max_tokens=100))
    message = str(err.value)
    assert "maximum context length is 256 tokens" in message
    assert "300 tokens (200 in the prompt, 100 in the completion)" in message
    assert not tiny_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1, -3], "token ids must be integers in [0, 49152)"),
        ([1, 49152], "token ids must be integers in [0, 49152)"),
        ([1, "a"], "token ids must be integers"),
        ([True], "token ids must be integers"),
    ],
)
def test_bad_prompts_are_rejected(tiny_engine, prompt, expected: str) -> None:
    with pytest.raises(RequestError, match=None) as err:
        tiny_engine.add_request("r", prompt, SamplingParams())
    assert expected in str(err.value)


def test_duplicate_request_id_is_rejected(tiny_engine) -> None:
    tiny_engine.add_request("same", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in flight"):
        tiny_engine.add_request("same", [5, 6, 7], SamplingParams(max_tokens=2))


def test_full_waiting_queue_rejects_the_overflow_and_serves_the_rest(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_waiting=3)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [10 + i] * 5, params)
    with pytest.raises(QueueFullError, match="waiting queue is full \\(3 requests\\); retry later"):
        engine.add_request("overflow", [9] * 5, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(temperature=float("nan")), "temperature must be in"),
        (dict(temperature=-1.0), "temperature must be in"),
        (dict(top_p=0.0), "top_p must be in (0.0, 1.0]"),
        (dict(top_k=-2), "top_k must be in [0, "),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
        (dict(presence_penalty=3.0), "presence_penalty must be in"),
        (dict(stop=[""]), "stop must be a non-empty string"),
        (dict(max_tokens="5"), "max_tokens must be an integer"),
        (dict(logprobs=21), "logprobs must be in [0, 20]"),
    ],
)
def test_invalid_sampling_params_say_which_field_and_range(bad: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**bad)
    assert message in str(err.value)


def test_kv_cache_too_small_for_max_model_len_suggests_one_that_fits() -> None:
    with pytest.raises(KVCacheTooSmallError) as err:
        plan_kv_cache(memory_bytes=100 * 1024, bytes_per_block=1024, block_size=16, max_model_len=8192)
    assert "max_model_len 8,192 does not fit in the KV cache (1,600 tokens); use --max-model-len 1600" in str(err.value)


def test_engine_refuses_to_start_when_one_sequence_cannot_fit(tiny_model_dir: Path) -> None:
    # tiny model: 3 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 768 bytes per token
    with pytest.raises(KVCacheTooSmallError, match="use --max-model-len 160 or give the cache more memory"):
        make_engine(tiny_model_dir, max_model_len=1024, kv_cache_memory=10 * 16 * 768)


def test_capacity_counts_blocks_tokens_and_concurrency() -> None:
    capacity = plan_kv_cache(memory_bytes=64 * 4096, bytes_per_block=4096, block_size=16, max_model_len=256)
    assert (capacity.num_blocks, capacity.num_tokens, capacity.max_concurrency) == (64, 1024, 4.0)
    assert "64 blocks x 16 tokens = 1,024 tokens" in capacity.describe()
    assert "4.00 sequences of max_model_len 256" in capacity.describe()
