"""Throughput of continuous batching vs static batching vs HF transformers, side by side in one run.

    python -m bench.engine_throughput --num-requests 64 --out bench/results
    python -m bench.engine_throughput --dtype bfloat16 --also-dtype float32 --skip static   # where the CPU has bfloat16

The Anyscale-style workload (bench/workload.py): N requests submitted at once, prompts of 16-256 tokens,
outputs exponential (mean 64, cap 256), EOS ignored; SmolLM2-135M-Instruct, fp32 (or --dtype), 2 threads.
Reports useful tokens/s (each request's own output tokens), ratios, model FLOP utilization against this
machine's GEMM peak in the same dtype measured in the same run, peak KV utilization, and concurrency against
reserving max_model_len per sequence. Writes JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.plotting import finish, pyplot
from bench.workload import BenchRequest, RunResult, anyscale_workload
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_files import resolve_model
from kvfleet.engine.model_loader import pick_dtype
from kvfleet.engine.packed_linear import PackedLinear, can_pack
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.step_profile import StepProfile

DTYPES = ("float32", "bfloat16")  # the dtypes this benchmark compares (torch dtypes by the engine's pick_dtype)
CPU = torch.device("cpu")
MAX_MODEL_LEN = 2048
PREALLOCATED_SEQS = 8  # the KV budget: what reserving max_model_len per sequence would hold this many of


def gemm_peak_gflops(size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best GEMM rate in `dtype` of this machine right now, in GFLOP/s: torch's matmul or a oneDNN-packed one."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    candidates = [lambda: a @ b]
    if can_pack(CPU, dtype):
        packed = PackedLinear(b, None)
        candidates.append(lambda: packed(a))
    best = float("inf")
    for gemm in candidates:
        gemm()
        for _ in range(repeats):
            start = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def useful_flops(config: ModelConfig, requests: list[BenchRequest]) -> float:
    """Prefill + decode FLOPs of the useful tokens: matmuls, attention over the context, LM head per output token."""
    matmul = 2 * config.num_params(include_embedding=False)
    attention_per_ctx = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    lm_head = 2 * config.hidden_size * config.vocab_size
    total = 0.0
    for r in requests:
        prompt = len(r.prompt_token_ids)
        tokens = prompt + r.output_len - 1  # the last output token is sampled, never fed back
        total += tokens * matmul + attention_per_ctx * tokens * (tokens + 1) / 2 + r.output_len * lm_head
    return total


def run_kvfleet(requests: list[BenchRequest], static: bool, kv_tokens: int, static_batch: int = 8,
                block_size: int = 16, profile: bool = False, dtype: str = "float32") -> RunResult:
    model_config = ModelConfig.from_dir(resolve_model("smollm2-135m-instruct"))
    per_token = model_config.kv_bytes_per_token * pick_dtype(dtype, CPU).itemsize
    engine = LLMEngine(EngineConfig(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=static_batch if static else 256, max_num_batched_tokens=2048,
        static_batching=static, block_size=block_size, dtype=dtype,
        kv_cache_memory=kv_tokens * per_token, max_num_waiting=len(requests) + 1,
    ), show_progress=False)
    engine.generate([[100] * 32], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    engine.profile = StepProfile() if profile else None
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_token_ids,
                           SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    bm = engine.block_manager
    peak_blocks, live_at_peak, peak_running, steps = 0, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running = engine.scheduler.running
        used = bm.num_blocks - bm.num_free_blocks
        peak_running = max(peak_running, len(running))
        if used > peak_blocks:
            peak_blocks, live_at_peak = used, sum(s.num_computed_tokens for s in running)
    seconds = time.perf_counter() - start
    name = f"kvfleet static batches of {static_batch}" if static else "kvfleet continuous batching"
    if block_size != 16:
        name += f", {block_size}-token blocks"
    if dtype != "float32":
        name += f", {dtype}"
    if engine.profile is not None:
        print(f"{name}: where the steps' time went\n{engine.profile.table()}", flush=True)
    return RunResult(name, seconds, sum(r.output_len for r in requests), {
        "block_size": block_size, "step_profile": engine.profile.summary() if engine.profile else None,
        "dtype": dtype, "steps": steps, "kv_blocks": bm.num_blocks, "peak_blocks_used": peak_blocks,
        "peak_kv_utilization": live_at_peak / (peak_blocks * bm.block_size) if peak_blocks else 0.0,
        "peak_running": peak_running, "preemptions": engine.scheduler.num_preemptions,
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--skip", nargs="*", default=[], choices=["static", "hf-static", "hf-continuous"])
    parser.add_argument("--block-size", type=int, nargs="*", default=[],
                        help="also run continuous batching with these KV block sizes (its KV waste and speed)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="every system's weights, activations and KV cache (bfloat16: where the CPU has it)")
    parser.add_argument("--also-dtype", choices=DTYPES, nargs="*", default=[],
                        help="also run continuous batching in these dtypes, side by side")
    parser.add_argument("--profile", action="store_true",
                        help="print where continuous batching's steps spend their time (engine/step_profile.py)")
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.replot:
        _chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    torch.set_num_threads(2)
    requests = anyscale_workload(args.num_requests)
    model_dir = resolve_model("smollm2-135m-instruct")
    config = ModelConfig.from_dir(model_dir)
    kv_tokens = PREALLOCATED_SEQS * MAX_MODEL_LEN

    dtype, dtypes = args.dtype, [args.dtype, *args.also_dtype]
    peaks_before = {d: gemm_peak_gflops(dtype=pick_dtype(d, CPU)) for d in dtypes}
    results = [run_kvfleet(requests, static=False, kv_tokens=kv_tokens, profile=args.profile, dtype=dtype)]
    for block_size in args.block_size:
        results.append(run_kvfleet(requests, static=False, kv_tokens=kv_tokens, block_size=block_size,
                                   profile=args.profile, dtype=dtype))
    for other in args.also_dtype:
        results.append(run_kvfleet(requests, static=False, kv_tokens=kv_tokens, profile=args.profile, dtype=other))
    if "static" not in args.skip:
        results.append(run_kvfleet(requests, static=True, kv_tokens=kv_tokens, dtype=dtype))
    if "hf-static" not in args.skip or "hf-continuous" not in args.skip:
        from bench.hf_baselines import run_hf_continuous, run_hf_static

        if "hf-static" not in args.skip:
            results.append(run_hf_static(model_dir, requests, batch_size=8, dtype=pick_dtype(dtype, CPU)))
        if "hf-continuous" not in args.skip:
            results.append(run_hf_continuous(model_dir, requests, dtype=pick_dtype(dtype, CPU)))
    peaks = {d: max(peaks_before[d], gemm_peak_gflops(dtype=pick_dtype(d, CPU))) for d in dtypes}
    peak = peaks[dtype]

    flops = useful_flops(config, requests)
    ours = results[0]
    report = {
        "workload": {"num_requests": len(requests), "useful_tokens": ours.useful_tokens,
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "useful_gflop": flops / 1e9},
        "dtype": dtype,
        "gemm_peak_gflops": peak,  # in the run's dtype; each system's model FLOP utilization is against its own dtype's
        "gemm_peak_gflops_by_dtype": peaks,
        "kv_budget_tokens": kv_tokens,
        "preallocated_concurrency": PREALLOCATED_SEQS,
        "systems": [{**asdict(r), "tokens_per_s": r.tokens_per_s,
                     "mfu": flops / r.seconds / (peaks[r.extra.get("dtype", dtype)] * 1e9),
                     "ratio_of_kvfleet_to_this": ours.tokens_per_s / r.tokens_per_s} for r in results],
    }
    blocks_per_request = [-(-(len(r.prompt_token_ids) + r.output_len) // 16) for r in requests]
    paged_fit = (kv_tokens // 16) / (sum(blocks_per_request) / len(requests))
    report["concurrency"] = {
        "preallocated_max_model_len": PREALLOCATED_SEQS,
        "paged_fit_at_final_length": paged_fit,  # this workload's mean sequence, in 16-token blocks
        "paged_measured_peak_running": ours.extra["peak_running"],
        "ratio_fit": paged_fit / PREALLOCATED_SEQS,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_throughput.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    _chart(report, args.out / "engine_throughput.png")


LABELS = {"hf-static": "HF generate, static batches of 8", "hf-continuous": "HF continuous batching"}


def _chart(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    systems = report["systems"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [LABELS.get(s["name"], s["name"]) for s in systems]
    values = [s["tokens_per_s"] for s in systems]
    bars = ax.barh(names[::-1], values[::-1], color=["#999"] * (len(values) - 1) + ["#2a7"])
    ax.bar_label(bars, fmt="%.1f tok/s", padding=3)
    ax.set_xlim(0, max(values) * 1.25)
    ax.set_xlabel("useful output tokens per second (higher is better)")
    workload = report["workload"]
    ax.set_title(f"SmolLM2-135M {report.get('dtype', 'float32')}, 2 CPU threads: {workload['num_requests']} requests, "
                 f"{workload['useful_tokens']} useful tokens", fontsize=10)
    finish(fig, path, dpi=120)


if __name__ == "__main__":
    main()
