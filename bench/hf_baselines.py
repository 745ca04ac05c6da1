"""HF transformers baselines: padded static batches with `generate`, and HF's own continuous batching.

Run from the repository root: `python -m bench.hf_baselines --num-requests 16`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.generation.continuous_batching import ContinuousBatchingManager

from bench.workload import BenchRequest, RunResult, anyscale_workload
from kvfleet.engine.model_files import DEFAULT_MODEL, resolve_model

NUM_THREADS = 2  # on a shared 2-core machine, 1 avoids OpenMP stalls when another process holds a core
PAD_TOKEN_ID = 0  # any id: padded positions are masked out
NO_EOS = -1  # HF continuous batching reads a negative EOS id as "never stop early"
WARMUP = BenchRequest([100] * 8, output_len=2)


def load_model(model_dir: Path, threads: int = NUM_THREADS, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model on CPU in `dtype`, with EOS unset so that `generate` runs every row to max_new_tokens."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # generate() fills unset fields from model.generation_config, so EOS must go from there, not just from our config.
    model.generation_config.eos_token_id = None
    return model


def static_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests in submission order, cut into consecutive batches."""
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def left_padded(batch: list[BenchRequest]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of a batch, padded on the left to its longest prompt."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = [[PAD_TOKEN_ID] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
    mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch]
    return torch.tensor(ids), torch.tensor(mask)


def greedy_config(max_new_tokens: int, eos_token_id: int | None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                            pad_token_id=PAD_TOKEN_ID)


@torch.inference_mode()
def generate_static_batch(model: PreTrainedModel, batch: list[BenchRequest]) -> int:
    """Runs one padded batch until its longest member is done; returns the model steps (forward passes) taken."""
    input_ids, attention_mask = left_padded(batch)
    max_new_tokens = max(r.output_len for r in batch)
    out = model.generate(input_ids, attention_mask=attention_mask,
                         generation_config=greedy_config(max_new_tokens, eos_token_id=None))
    generated = out.shape[1] - input_ids.shape[1]
    if generated != max_new_tokens:
        raise RuntimeError(f"a static batch generated {generated} tokens, not {max_new_tokens}: EOS was not ignored")
    return generated


def run_hf_static(model_dir: Path, requests: list[BenchRequest], batch_size: int = 8,
                  threads: int = NUM_THREADS, dtype: torch.dtype = torch.float32) -> RunResult:
    """HF `generate` over padded static batches of `batch_size`, greedy, EOS ignored."""
    model = load_model(model_dir, threads, dtype)
    generate_static_batch(model, [WARMUP])
    batches = static_batches(requests, batch_size)
    start = time.perf_counter()
    steps = sum(generate_static_batch(model, batch) for batch in batches)
    seconds = time.perf_counter() - start
    useful = sum(r.output_len for r in requests)
    generated = sum(len(b) * max(r.output_len for r in b) for b in batches)
    padded_prompt = sum(len(b) * max(len(r.prompt_token_ids) for r in b) for b in batches)
    return RunResult("hf-static", seconds, useful, {
        "batch_size": batch_size,
        "batches": len(batches),
        "steps": steps,
        "generated_tokens": generated,
        "wasted_generated_tokens": generated - useful,
        "prompt_pad_tokens": padded_prompt - sum(len(r.prompt_token_ids) for r in requests),
        "attn_implementation": model.config._attn_implementation,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
    })


def kv_bytes_per_block(config: PretrainedConfig, page_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one HF cache block: keys and values of `page_size` tokens for every layer, in `dtype`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * page_size * dtype.itemsize


def collect_results(manager: ContinuousBatchingManager, request_ids: list[str]) -> dict[str, list[int]]:
    """Generated tokens of each request id, once all have finished; raises on a failed request or a dead loop."""
    tokens: dict[str, list[int]] = {}
    while len(tokens) < len(request_ids):
        output = manager.get_result(timeout=1)
        if output is None:
            if not manager.is_running():
                raise RuntimeError(f"HF continuous batching stopped with {len(tokens)}/{len(request_ids)} done")
            continue
        if output.error is not None:
            raise RuntimeError(f"HF continuous batching failed request {output.request_id}: {output.error}")
        if output.is_finished():
            tokens[output.request_id] = output.generated_tokens
    return tokens


def run_hf_continuous(model_dir: Path, requests: list[BenchRequest], kv_cache_bytes: int = 1 << 30,
                      page_size: int = 256, max_batch_tokens: int = 2048,
                      max_requests_per_batch: int = 128, threads: int = NUM_THREADS,
                      dtype: torch.dtype = torch.float32) -> RunResult:
    """HF transformers' continuous batching (paged cache, SDPA on CPU), per-request max_new_tokens, EOS ignored."""
    model = load_model(model_dir, threads, dtype)
    block_bytes = kv_bytes_per_block(model.config, page_size, dtype)
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=max(1, kv_cache_bytes // block_bytes),
                                         max_batch_tokens=max_batch_tokens,
                                         max_requests_per_batch=max_requests_per_batch)
    # On CPU only "sdpa" and "paged|eager" run (flash needs CUDA); sdpa was the faster in a short check.
    model.set_attn_implementation("sdpa")
    generation_config = greedy_config(max(r.output_len for r in requests), eos_token_id=NO_EOS)
    with model.continuous_batching_context_manager(generation_config=generation_config,
                                                   continuous_batching_config=cb_config, block=True) as manager:
        warmup_id = manager.add_request(WARMUP.prompt_token_ids, request_id="warmup",
                                        max_new_tokens=WARMUP.output_len, eos_token_id=NO_EOS)
        collect_results(manager, [warmup_id])  # also waits for the paged cache to be allocated
        steps_before = manager.current_batch
        start = time.perf_counter()
        request_ids = [manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len,
                                           eos_token_id=NO_EOS) for i, r in enumerate(requests)]
        tokens = collect_results(manager, request_ids)
        seconds = time.perf_counter() - start
        steps = manager.current_batch - steps_before
        attn_implementation = model.config._attn_implementation
        resolved = manager.continuous_batching_config
    wrong = [(i, r.output_len, len(tokens[str(i)])) for i, r in enumerate(requests)
             if len(tokens[str(i)]) != r.output_len]
    if wrong:
        raise RuntimeError(f"HF continuous batching generated wrong lengths (request, wanted, got): {wrong[:5]}")
    return RunResult("hf-continuous", seconds, sum(r.output_len for r in requests), {
        "api": "continuous_batching_context_manager + add_request(max_new_tokens=output_len, eos_token_id=-1)",
        "attn_implementation": attn_implementation,
        "steps": steps,
        "kv_cache_bytes": resolved.num_blocks * block_bytes,
        "num_blocks": resolved.num_blocks,
        "page_size": resolved.page_size,
        "max_batch_tokens": resolved.max_batch_tokens,
        "max_requests_per_batch": resolved.max_requests_per_batch,
        "prefix_sharing": resolved.allow_block_sharing,
        "scheduler": resolved.scheduler_type,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description="HF transformers baselines on the Anyscale-style workload")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=NUM_THREADS)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    requests = anyscale_workload(num_requests=args.num_requests)
    results = []
    for run in (run_hf_static, run_hf_continuous):
        results.append(run(model_dir, requests, threads=args.threads))
        print(f"{results[-1].name:14s} {results[-1].useful_tokens} tokens in {results[-1].seconds:.1f} s: "
              f"{results[-1].tokens_per_s:.1f} tokens/s  {results[-1].extra}", flush=True)
    print(f"hf-continuous / hf-static: {results[1].tokens_per_s / results[0].tokens_per_s:.2f}x")


if __name__ == "__main__":
    main()
