"""A request's seed fixes its sampled tokens, whatever else shares its batches."""

from __future__ import annotations

from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams

TARGET = [101, 2020, 3030, 404, 55, 606, 7070]


def sampled_tokens(engine: LLMEngine, companions: list[tuple[list[int], SamplingParams]], delay_steps: int,
                   seed: int = 1234) -> list[int]:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
    for i, (prompt, p) in enumerate(companions):
        engine.add_request(f"companion-{i}", prompt, p)
    tokens: list[int] = []
    step = 0
    while engine.has_unfinished_requests() or step <= delay_steps:
        if step == delay_steps:
            engine.add_request("target", TARGET, params)
        for out in engine.step():
            if out.request_id == "target":
                tokens += out.new_token_ids
        step += 1
    return tokens


def test_same_seed_same_tokens_alone_and_in_different_batches(tiny_engine: LLMEngine) -> None:
    alone = sampled_tokens(tiny_engine, [], delay_steps=0)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    random_ = SamplingParams(max_tokens=25, temperature=0.8, ignore_eos=True)  # no seed: draws from the engine's RNG
    seeded = SamplingParams(max_tokens=15, temperature=1.3, seed=7, ignore_eos=True)
    busy = sampled_tokens(tiny_engine, [([9] * 40, greedy), ([3, 4] * 30, random_), ([77] * 5, seeded)],
                          delay_steps=2)
    busier = sampled_tokens(tiny_engine, [([8] * 90, random_)] * 1 + [([i, i + 1] * 9, random_) for i in range(6)],
                            delay_steps=5)
    assert len(alone) == 20
    assert alone == busy == busier


def test_different_seeds_give_different_tokens(tiny_engine: LLMEngine) -> None:
    assert sampled_tokens(tiny_engine, [], 0, seed=1) != sampled_tokens(tiny_engine, [], 0, seed=2)
