"""CUDA graphs of decode steps against eager decode steps, side by side in one process (needs a CUDA GPU).

    python -m bench.decode_graphs --model DIR [--num-requests 64] [--out bench/results]
    python -m bench.decode_graphs --random-like DIR    # random weights of DIR's config.json, its tokenizer files

Two engines on one model: one with --enforce-eager, one that captures decode steps as CUDA graphs at start. Each
runs the same greedy workload (N requests of 32-token prompts, outputs of 16-256 tokens, EOS ignored, so the batch
shrinks from N to 1 as requests end); reports tokens/s, the mean decode step time by batch size, the capture time,
and how many requests' greedy outputs are identical between the two.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def random_model_like(source: Path, dtype: torch.dtype) -> Path:
    """A model of source's config.json with random weights (what this machine cannot download), its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="kvfleet-random-model-"))
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, torch_dtype=dtype).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 20_000) for _ in range(32)], rng.randint(16, 256)) for _ in range(n)]


def run(model: Path, eager: bool, requests: list[tuple[list[int], int]], max_num_seqs: int,
        dtype: str = "auto") -> dict:
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=512, max_num_seqs=max_num_seqs, dtype=dtype,
                                    kv_cache_memory="4GiB", enforce_eager=eager, attention_backend="triton"),
                       show_progress=False)
    start_s = time.perf_counter() - started
    engine.generate([[100] * 32], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
    steps: dict[int, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    torch.cuda.synchronize()
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decode_only = engine.scheduler.num_waiting == 0 and all(
            s.num_computed_tokens >= s.num_prompt_tokens for s in running)
        batch = len(running)
        t = time.perf_counter()
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if decode_only and batch:
            steps.setdefault(batch, []).append(time.perf_counter() - t)
    seconds = time.perf_counter() - began
    tokens = sum(n for _, n in requests)
    capture_s = engine.startup_s.get("cuda_graphs")
    del engine  # its KV cache goes back before the next engine is built
    gc.collect()
    torch.cuda.empty_cache()
    return {"eager": eager, "seconds": seconds, "tokens_per_s": tokens / seconds, "engine_start_s": start_s,
            "cuda_graphs_capture_s": capture_s,
            "decode_step_ms": {b: 1000 * sum(v) / len(v) for b, v in sorted(steps.items())}, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a local HF-format model directory")
    source.add_argument("--random-like", type=Path, help="random weights of this directory's config.json")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="the engines' --dtype (auto: bfloat16 on a GPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_graphs needs a CUDA GPU")
    model = args.model or random_model_like(args.random_like, torch.bfloat16)
    requests = workload(args.num_requests)
    eager, graphs = (run(model, e, requests, args.num_requests, args.dtype) for e in (True, False))
    same = sum(eager["outputs"][k] == graphs["outputs"][k] for k in eager["outputs"])
    print(f"{torch.cuda.get_device_name()}, {args.num_requests} requests, {sum(n for _, n in requests)} tokens")
    print(f"eager: {eager['tokens_per_s']:.0f} tokens/s; CUDA graphs: {graphs['tokens_per_s']:.0f} tokens/s "
          f"({graphs['tokens_per_s'] / eager['tokens_per_s']:.2f}x); capture {graphs['cuda_graphs_capture_s']:.1f} s; "
          f"greedy outputs identical for {same} of {len(requests)} requests")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}")
    for batch in sorted(eager["decode_step_ms"], reverse=True):
        if batch in graphs["decode_step_ms"] and (batch in (1, 2, 4) or batch % 8 == 0):
            e, g = eager["decode_step_ms"][batch], graphs["decode_step_ms"][batch]
            print(f"{batch:5d} {e:9.2f} {g:9.2f} {e / g:7.2f}x")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for r in (eager, graphs):
            r.pop("outputs")
        (args.out / f"decode_graphs_{model.name}.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "identical_outputs": same, "requests": len(requests),
             "eager": eager, "cuda_graphs": graphs}, indent=2))


if __name__ == "__main__":
    main()
