"""Many adapters, one batch: the engine's greedy answer for each request equals transformers with that request's
adapter merged by peft (float32, the real SmolLM2), whatever mix of adapters and the base model shares its steps, with
four slots or with two (adapters then wait their turn and swap in and out of slots). The prefix cache never lets one
adapter's request hit another's blocks, and an adapter evicted from host memory is read again when it is needed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.lora_adapters import make_adapter, merged_greedy

NAMES = ("sql", "poet", "coder", "french")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    # ranks 8 and 16, all seven projections or some: one engine's slots hold adapters of several shapes
    shapes = {"sql": (8, None), "poet": (16, ("q_proj", "v_proj")), "coder": (8, ("gate_proj", "up_proj", "down_proj")),
              "french": (4, None)}
    return {name: make_adapter(smollm2_dir, root / name, seed=i, rank=rank, std=0.06,
                               **({"targets": targets} if targets else {}))
            for i, (name, (rank, targets)) in enumerate(shapes.items())}


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(smollm2_dir: Path, adapters: dict[str, Path], prompts: list[list[int]]) -> dict:
    return {name: merged_greedy(smollm2_dir, adapters.get(name), prompts, NEW_TOKENS) for name in (None, *NAMES)}


def lora_engine(model_dir: Path, adapters: dict[str, Path], **overrides: object) -> LLMEngine:
    settings = dict(max_model_len=256, kv_cache_memory="64MiB", max_loras=4,
                    lora_modules=[f"{name}={path}" for name, path in adapters.items()])
    return make_engine(model_dir, **{**settings, **overrides})


def run_all(engine: LLMEngine, requests: list[tuple[str | None, list[int]]]) -> tuple[list[list[int]], int]:
    """Every request at once, stepped to the end; each answer's tokens, and the most distinct adapters in a step."""
    tokens: dict[str, list[int]] = {}
    for i, (name, prompt) in enumerate(requests):
        spec = None if name is None else engine.lora_registry.get(name)
        engine.add_request(str(i), prompt, GREEDY, lora=spec)
        tokens[str(i)] = []
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finish_reason in (None, "length"), out.error
            tokens[out.request_id] += out.new_token_ids
        most = max(most, len(engine.scheduler.running_adapters()))
    return [tokens[str(i)] for i in range(len(requests))], most


def mixed(prompts: list[list[int]]) -> list[tuple[str | None, list[int]]]:
    """Each prompt for the base model and every adapter, interleaved: each step mixes them."""
    return [(name, prompt) for prompt in prompts for name in (None, *NAMES)]


def test_the_adapters_change_the_answers(expected: dict) -> None:
    """Otherwise the equalities below would say nothing."""
    assert sum(expected[name] != expected[None] for name in NAMES) == len(NAMES)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_each_request_gets_its_own_adapters_answer_in_a_mixed_batch(smollm2_dir: Path, adapters: dict[str, Path],
                                                                    prompts: list[list[int]], expected: dict,
                                                                    max_loras: int) -> None:
    engine = lora_engine(smollm2_dir, adapters, max_loras=max_loras)
    requests = mixed(prompts)
    got, most = run_all(engine, requests)
    for (name, prompt), answer in zip(requests, got, strict=True):
        assert answer == expected[name][prompts.index(prompt)], f"adapter {name} on {prompt}"
    assert most == max_loras  # the batch held as many adapters as it had slots, never more


def test_an_adapters_request_never_hits_another_ones_blocks(smollm2_dir: Path, adapters: dict[str, Path],
                                                            prompts: list[list[int]], expected: dict) -> None:
    engine = lora_engine(smollm2_dir, adapters, block_size=4)
    engine.block_manager.events = []
    prompt = prompts[1]
    cached = []
    for i, name in enumerate((None, "sql", "sql", "poet", None)):
        engine.add_request(str(i), prompt, GREEDY, lora=None if name is None else engine.lora_registry.get(name))
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                if out.finished:
                    cached.append(out.metrics.num_cached_tokens)
        assert tokens == expected[name][1]
    whole_blocks = (len(prompt) - 1) // 4 * 4
    # the base model's blocks served no adapter; sql's second request hit sql's own; the base model hit its own
    assert cached == [0, 0, whole_blocks, 0, whole_blocks]
    stored = {e.lora_name for e in engine.block_manager.take_events() if type(e).__name__ == "BlockStored"}
    assert stored == {None, "sql", "poet"}  # the KV events name each adapter's blocks as its own


def test_an_adapter_evicted_from_host_memory_is_read_again_and_one_whose_files_went_fails_alone(
        smollm2_dir: Path, adapters: dict[str, Path], prompts: list[list[int]], expected: dict,
        tmp_path: Path) -> None:
    gone = shutil.copytree(adapters["french"], tmp_path / "french")
    engine = lora_engine(smollm2_dir, {**adapters, "french": gone}, max_loras=1, max_cpu_loras=1)
    assert engine.lora_registry.num_in_host_memory == 1  # of four: the rest wait on disk
    loads = engine.lora_registry.loads
    got, _ = run_all(engine, [("sql", prompts[0]), ("poet", prompts[0])])
    assert got == [expected["sql"][0], expected["poet"][0]]
    assert engine.lora_registry.loads >= loads + 2  # read again from their directories
    shutil.rmtree(gone)
    engine.add_request("gone", prompts[0], GREEDY, lora=engine.lora_registry.get("french"))
    engine.add_request("base", prompts[0], GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["gone"].finish_reason == "error" and "could not be read again" in finished["gone"].error
    assert finished["base"].finish_reason == "length"
