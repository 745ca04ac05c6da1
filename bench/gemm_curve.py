"""The model's GEMM efficiency against tokens per step: what a step's token budget (the prefill chunk) costs.

    python -m bench.gemm_curve --out bench/results      # ~1 min

Runs every linear layer of SmolLM2-135M (prepacked for oneDNN, as the engine runs them) for M tokens at once and
reports GFLOP/s, the share of the best rate, and the smallest budget within 5 % of the best: below it a step pays
for streaming the weights, above it a longer chunk only delays the decodes that share its step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_files import resolve_model
from kvfleet.engine.packed_linear import PackedLinear

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
WITHIN = 0.95


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused projections, as the engine builds them."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def measure(config: ModelConfig, tokens: tuple[int, ...] = TOKENS, repeats: int = 3) -> list[dict]:
    shapes = layer_shapes(config)
    layers = [[PackedLinear(torch.randn(out, inp), None) for out, inp in shapes]
              for _ in range(config.num_hidden_layers)]  # every layer's own weights: they stream from memory
    flops_per_token = 2 * sum(out * inp for out, inp in shapes) * config.num_hidden_layers
    rows = []
    for m in tokens:
        inputs = [torch.randn(m, inp) for _, inp in shapes]

        def step(inputs: list[torch.Tensor] = inputs) -> None:
            for layer in layers:
                for linear, x in zip(layer, inputs, strict=True):
                    linear(x)

        step()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
        rows.append({"tokens": m, "seconds": best, "gflops": flops_per_token * m / best / 1e9})
    top = max(row["gflops"] for row in rows)
    for row in rows:
        row["share_of_best"] = row["gflops"] / top
    return rows


def smallest_efficient_budget(rows: list[dict], within: float = WITHIN) -> int:
    return min(row["tokens"] for row in rows if row["share_of_best"] >= within)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_dir(resolve_model("smollm2-135m-instruct"))
    rows = measure(config)
    budget = smallest_efficient_budget(rows)
    print("tokens  ms/step  GFLOP/s  share of best")
    for row in rows:
        print(f"{row['tokens']:6d} {row['seconds'] * 1e3:8.1f} {row['gflops']:8.1f} {row['share_of_best']:8.1%}")
    print(f"smallest token budget within {1 - WITHIN:.0%} of the best GEMM rate: {budget}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"model": "smollm2-135m-instruct", "threads": args.threads, "rows": rows, "efficient_budget": budget}
    (args.out / "gemm_curve.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
