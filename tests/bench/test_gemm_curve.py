"""bench/gemm_curve.py measures the model's own layer shapes and names the smallest budget near the best rate."""

from __future__ import annotations

from pathlib import Path

from bench.gemm_curve import layer_shapes, measure, smallest_efficient_budget
from kvfleet.engine.model_config import ModelConfig


def test_the_curve_runs_on_the_models_layers(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    q = config.num_attention_heads * config.head_dim
    assert layer_shapes(config)[0] == (q + 2 * config.num_key_value_heads * config.head_dim, config.hidden_size)
    rows = measure(config, tokens=(1, 64), repeats=1)
    assert [row["tokens"] for row in rows] == [1, 64]
    assert all(row["gflops"] > 0 for row in rows)
    assert max(row["share_of_best"] for row in rows) == 1.0


def test_the_smallest_budget_within_five_percent_of_the_best_is_chosen() -> None:
    rows = [{"tokens": t, "share_of_best": s} for t, s in ((64, 0.5), (512, 0.96), (2048, 1.0), (4096, 0.8))]
    assert smallest_efficient_budget(rows) == 512
    assert smallest_efficient_budget(rows, within=0.99) == 2048
