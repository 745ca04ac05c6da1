"""Multi-LoRA batching, kvfleet's engine beside vLLM's on the same CPU and the same adapters (issue 38's target).

    python -m bench.lora_batching --json docs/benchmarks/lora_batching.json

Eight adapters of rank 16 on every projection (`kvfleet lora example`, seeds 0-7) of SmolLM2-135M-Instruct. Each
engine runs three ways, one engine at a time, each under the same load from vLLM's own generator (`vllm bench serve`,
random 128-token prompts, 128-token answers, EOS ignored, every request at once, after a warm-up pass):

- base: the base model alone (no adapters, LoRA off);
- batched: `--max-loras 8`, requests spread round-robin over the eight adapters;
- one-at-a-time: `--max-loras 1` (one adapter per step), the same requests; `--max-cpu-loras 8` keeps every adapter
  in host memory for both engines, so this measures the batching, not disk reads.

Targets: batched output tok/s >= 0.8x base, and >= 3x one-at-a-time. vLLM runs in its best CPU settings (both cores,
Intel OpenMP) and in the dtype `kvfleet up` would give it here (float32 where the CPU has no bfloat16 instructions).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.engine_vs_vllm import FIGURES, bench_serve, machine, start_engine
from bench.fleet_procs import model_dir
from kvfleet.engine.lora_example import write_example_adapter
from kvfleet.fleet.cpu_features import flags_have_bf16, host_cpu_flags

ADAPTERS = 8
RANK = 16
SHAPE = ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128"]
MODES = ("base", "batched", "one-at-a-time")
ENGINES = ("kvfleet", "vllm-best")


def engine_flags(mode: str, adapters: dict[str, Path]) -> list[str]:
    if mode == "base":
        return []
    return ["--enable-lora", "--max-loras", "1" if mode == "one-at-a-time" else str(len(adapters)),
            "--max-lora-rank", str(RANK), "--max-cpu-loras", str(len(adapters)),
            "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]


def load_flags(mode: str, adapters: dict[str, Path]) -> list[str]:
    if mode == "base":
        return SHAPE
    return [*SHAPE, "--lora-modules", *adapters, "--lora-assignment", "round-robin"]


def run(kind: str, mode: str, args: argparse.Namespace, model: Path, adapters: dict[str, Path], work: Path) -> dict:
    child = start_engine(kind, args.dtype, model, work / "logs", engine_flags(mode, adapters))
    try:
        bench_serve(child.url, model, "", max(8, args.num_prompts // 4), None, work / f"{kind}-{mode}-warmup.json",
                    args.seed + 1, load_flags(mode, adapters))
        result = bench_serve(child.url, model, "", args.num_prompts, None, work / f"{kind}-{mode}.json", args.seed,
                             load_flags(mode, adapters))
    finally:
        child.stop()
    print(f"{kind:10s} {mode:14s} " + "  ".join(f"{k}={result.get(k, float('nan')):.1f}" for k in FIGURES),
          flush=True)
    return result


def verdicts(report: dict) -> dict:
    out = {}
    for kind, modes in report["engines"].items():
        tput = {mode: modes[mode]["output_throughput"] for mode in modes}
        out[kind] = {"batched_vs_base": tput["batched"] / tput["base"],
                     "batched_vs_one_at_a_time": tput["batched"] / tput["one-at-a-time"]}
    if {"kvfleet", "vllm-best"} <= set(report["engines"]):
        out["kvfleet_vs_vllm"] = {mode: report["engines"]["kvfleet"][mode]["output_throughput"]
                                  / report["engines"]["vllm-best"][mode]["output_throughput"] for mode in MODES}
    return out


def table(report: dict) -> str:
    lines = ["| engine | mode | out tok/s | mean TTFT ms | mean TPOT ms |", "|---|---|---|---|---|"]
    for kind, modes in report["engines"].items():
        for mode, r in modes.items():
            lines.append(f"| {kind} | {mode} | {r['output_throughput']:.0f} | {r['mean_ttft_ms']:.0f} | "
                         f"{r['mean_tpot_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help=f"some of {', '.join(ENGINES)}")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: bfloat16 where the CPU has bfloat16 instructions, else float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if flags_have_bf16(host_cpu_flags()) else "float32"
    model = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="kvfleet-lora-batching-"))
    (work / "logs").mkdir()
    adapters = {f"adapter-{i}": write_example_adapter(model, work / "adapters" / str(i), RANK, seed=i)
                for i in range(ADAPTERS)}
    report = {"command": shlex.join(["python", "-m", "bench.lora_batching", *(argv or sys.argv[1:])]),
              "machine": machine(), "dtype": args.dtype, "model": args.model, "adapters": ADAPTERS, "rank": RANK,
              "num_prompts": args.num_prompts, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "engines": {}}
    for kind in [k for k in args.engines.split(",") if k]:
        report["engines"][kind] = {mode: run(kind, mode, args, model, adapters, work) for mode in MODES}
    report["verdicts"] = verdicts(report)
    report["table"] = table(report)
    print(report["table"])
    print(json.dumps(report["verdicts"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
