"""The asyncio front: concurrent streams, aborts that free KV blocks at once, errors surfaced to the caller."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.llm_engine import RequestError
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import QueueFullError
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_engine(tiny_model_dir: Path):
    engine = AsyncEngine(make_engine(tiny_model_dir, max_num_waiting=4))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], str]:
    tokens, text = [], ""
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        text += out.text_delta
    return tokens, text


def test_concurrent_streams_match_offline_generation(async_engine: AsyncEngine, tiny_engine) -> None:
    prompts = [[20 + i] * (5 + 7 * i) for i in range(4)]
    expected = tiny_engine.generate(prompts, GREEDY)

    async def main():
        return await asyncio.gather(*(collect(async_engine, p) for p in prompts))

    results = asyncio.run(main())
    for (tokens, text), want in zip(results, expected, strict=True):
        assert len(tokens) == 12
        assert text == want.text


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(async_engine: AsyncEngine) -> None:
    engine = async_engine.engine
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main() -> int:
        received = 0
        stream = async_engine.generate([5] * 40, long)
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.aclose()
        for _ in range(200):  # the engine thread frees the blocks within a step
            if not engine.requests and engine.stats().kv_blocks_free == engine.stats().kv_blocks_total:
                return received
            await asyncio.sleep(0.01)
        raise AssertionError("the aborted request still holds KV blocks")

    assert asyncio.run(main()) == 3


def test_invalid_request_raises_before_streaming(async_engine: AsyncEngine) -> None:
    async def main():
        async for _ in async_engine.generate([1] * 250, SamplingParams(max_tokens=50)):
            pass

    with pytest.raises(RequestError, match="maximum context length is 256 tokens"):
        asyncio.run(main())


def test_queue_overflow_surfaces_as_queue_full_while_the_rest_finish(async_engine: AsyncEngine) -> None:
    slow = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, [40 + i] * 8, slow) for i in range(12)),
                                    return_exceptions=True)

    results = asyncio.run(main())
    rejected = [r for r in results if isinstance(r, QueueFullError)]
    served = [r for r in results if isinstance(r, tuple)]
    assert len(rejected) + len(served) == 12
    assert rejected, "12 requests at once should overflow a waiting queue of 4"
    assert all(len(tokens) == 30 for tokens, _ in served)
