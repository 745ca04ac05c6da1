"""kvfleet's greedy tokens equal HF transformers' generate, under chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.packed_linear import can_pack
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.fleet.cpu_features import flags_have_bf16, host_cpu_flags
from tests.support.hf_parity import BF16_FLOOR, FIRST_TOKENS, TOP_LOGPROBS, chat_prompts
from tests.support.paths import ROOT

# Where the CPU has no bfloat16 instructions (torch emulates them, ~3x slower; the engine's default there is float32),

# the bfloat16 check runs on the first questions only: the same code paths, a fifth of the suite's minute.
EMULATED_QUESTIONS = 3
CPU = torch.device("cpu")


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
        kv_cache_memory=kv_blocks * fp32_bytes_per_block, dtype="float32",
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


def bf16_answers(model_dir: Path, tmp_path: Path, env: dict[str, str], count: int | None) -> tuple[dict, list[str]]:
    """The engine's first tokens in bfloat16 in a process of its own (for the first `count` questions, None: all),
    and the oneDNN kernels that ran there."""
    out = tmp_path / "answers.json"
    done = subprocess.run([sys.executable, "-m", "tests.support.bf16_first_tokens", str(model_dir), str(out),
                           *([str(count)] if count else [])],
                          env={**os.environ, **env, "ONEDNN_VERBOSE": "1"}, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = sorted({line.split(",")[6] for line in done.stdout.splitlines()
                      if line.startswith("onednn_verbose") and ",exec,cpu,inner_product," in line})
    return json.loads(out.read_text()), kernels


def hf_logprobs(model: LlamaForCausalLM, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """transformers' logprobs of each next token after the prompt and each prefix of the engine's own answer."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


# The engine's bfloat16 GEMMs (oneDNN, prepacked) run on AMX where the CPU has it and on AVX-512 BF16 otherwise;
# "avx512_bf16" caps oneDNN below AMX on an AMX CPU so that both paths are checked there.
@pytest.mark.parametrize("isa", ["this-cpu", "avx512_bf16"])
def test_smollm2_in_bfloat16_on_the_cpu_answers_as_transformers_within_bfloat16s_rounding(
        smollm2_dir: Path, tmp_path: Path, isa: str) -> None:
    """bfloat16 keeps 8 bits of mantissa, so answers round differently on every GEMM path (AMX, AVX-512 BF16, GPUs)
    and exact tokens hold on none of them: each of the engine's first tokens is transformers' float32 choice, or one
    within bfloat16's rounding of it, and every logprob it reports is within that rounding of float32's. The rounding
    is measured, not assumed: twice transformers' own bfloat16 distance from float32 on the same tokens."""
    flags = host_cpu_flags() or frozenset()
    if isa == "avx512_bf16" and not {"amx_bf16", "avx512_bf16"} <= flags:
        pytest.skip("the AVX-512 BF16 path below AMX is checked apart only on a CPU with both (else: this-cpu)")
    count = None if flags_have_bf16(flags) else EMULATED_QUESTIONS
    got, kernels = bf16_answers(smollm2_dir, tmp_path,
                                {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"} if isa == "avx512_bf16" else {}, count)
    assert got["decode_in_place"]
    assert got["packed"] == can_pack(CPU, torch.bfloat16)
    if got["packed"]:  # the path this case names is the one that ran
        assert kernels and all(("amx" in k) == (isa == "this-cpu" and "amx_bf16" in flags) for k in kernels), kernels
    prompts = chat_prompts(smollm2_dir, count)
    exact = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    rounded = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    worst_engine = worst_hf = 0.0
    picks = []
    for prompt, answer in zip(prompts, got["answers"], strict=True):
        tokens = [step["token"] for step in answer]
        assert len(tokens) == FIRST_TOKENS
        truth, hf_bf16 = hf_logprobs(exact, prompt, tokens), hf_logprobs(rounded, prompt, tokens)
        for pos, step in enumerate(answer):
            top = [token for token, _ in step["top"]]
            # greedy: the token taken has the best logprob (bfloat16's 8-bit logits tie often; argmax takes the
            # lowest id of a tie, which need not be listed first)
            assert len(top) == TOP_LOGPROBS and dict(step["top"]).get(step["token"]) == step["top"][0][1]
            worst_engine = max(worst_engine, *(abs(lp - truth[pos, t].item()) for t, lp in step["top"]))
            worst_hf = max(worst_hf, *(abs(hf_bf16[pos, t].item() - truth[pos, t].item()) for t in top))
            picks.append((truth[pos].max().item() - truth[pos, step["token"]].item(), step["token"],
                          truth[pos].argmax().item()))
    tolerance = max(BF16_FLOOR, 2 * worst_hf)
    print(f"{isa} ({', '.join(kernels) or 'unpacked'}): logprobs within {worst_engine:.3f} of float32's "
          f"(transformers in bfloat16: {worst_hf:.3f}); {sum(g == t for _, g, t in picks)}/{len(picks)} tokens "
          f"float32's own choice")
    assert worst_engine <= tolerance
    assert all(shortfall <= tolerance for shortfall, _, _ in picks), picks  # other picks only in near-ties
    assert sum(g == t for _, g, t in picks) >= 0.75 * len(picks)
