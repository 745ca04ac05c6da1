"""kvfleet's greedy tokens equal HF transformers' generate, under chunked prefill, prefix hits and preemption."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.packed_linear import PackedLinear, can_pack
from kvfleet.engine.sampling_params import SamplingParams

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea and the wind that blows over it at night.",
    "Explain in one sentence why the sky is blue, as if to a child who keeps asking why.",
    "List the planets of the solar system in order from the sun, then say which one is largest "
    "and which one has the most moons, and why Pluto is no longer counted among them.",
    "2+2=",
    "Translate 'good morning, how did you sleep?' into French, Spanish, German and Italian, "
    "and say for each language whether the greeting is formal or informal, with a short example of "
    "a reply that a friend might give in the same language.",
]
CPU = torch.device("cpu")
SYSTEM = ("You are a careful assistant for a fleet of language model servers. Answer briefly and precisely, "
          "and never invent facts you are not sure about.")


def chat_prompts(tokenizer_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [
        list(tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for q in QUESTIONS
    ]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # run every request to max_new_tokens, like ignore_eos
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        results.append(out[0, len(prompt):].tolist())
    return results


def kvfleet_staggered(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Submit two requests, then two more every few steps, while the earlier ones are mid-flight."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            for i, prompt in pending[:2]:
                engine.add_request(str(i), prompt, params)
            pending = pending[2:]
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            assert out.finish_reason in (None, "length"), out.error
        step += 1
        assert step < 5000, "the engine stalled"
    return [tokens[str(i)] for i in range(len(prompts))]


def check_parity(model_dir: Path, kv_blocks: int, max_new_tokens: int) -> LLMEngine:
    prompts = chat_prompts(model_dir)
    budget = 48
    assert max(len(p) for p in prompts) > budget, "some prompt must need chunked prefill"
    fp32_bytes_per_block = ModelConfig.from_dir(model_dir).kv_bytes_per_token * 4 * 16
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), block_size=16, max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=8,
        kv_cache_memory=kv_blocks * fp32_bytes_per_block,
    ), show_progress=False)
    got = kvfleet_staggered(engine, prompts, max_new_tokens)
    expected = hf_greedy(model_dir, prompts, max_new_tokens)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverged at token {_first_diff(g, e)}"
    stats = engine.stats()
    assert stats.num_preemptions >= 1, "the small KV pool should have forced a preemption"
    assert stats.prefix_cache_hits > 0, "the shared system prompt should have hit the prefix cache"
    assert stats.kv_blocks_free == stats.kv_blocks_total
    return engine


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_tiny_llama_matches_transformers(tiny_model_dir: Path) -> None:
    check_parity(tiny_model_dir, kv_blocks=24, max_new_tokens=24)


def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    check_parity(smollm2_dir, kv_blocks=24, max_new_tokens=16)


def test_smollm2_in_bfloat16_on_the_cpu_begins_every_answer_as_transformers_does(smollm2_dir: Path) -> None:
    """bfloat16 on the CPU (packed GEMMs where the CPU has bfloat16 instructions, the cache read in place): answers
    are bfloat16's, so they drift from transformers' in their own rounding after a few tokens (6 to 27 of 32 in a
    check, 2 of 8 equal throughout); each one's first tokens are the same."""
    prompts = chat_prompts(smollm2_dir)
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), block_size=16, max_model_len=256, max_num_seqs=8,
                                    dtype="bfloat16"), show_progress=False)
    assert engine.runner.backend.decode_in_place is not None
    assert any(isinstance(m, PackedLinear) for m in engine.model.modules()) == can_pack(CPU, torch.bfloat16)
    assert kvfleet_staggered(engine, prompts, 4) == hf_greedy(smollm2_dir, prompts, 4, dtype=torch.bfloat16)
