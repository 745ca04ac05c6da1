"""`kvfleet lora example DIR`: a LoRA adapter of random weights in PEFT's format, for trying multi-LoRA serving without
a fine-tune (its answers differ from the base model's, reproducibly by seed; they are not better ones)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvfleet.engine.lora_adapter import PROJECTIONS, projection_shapes
from kvfleet.engine.model_config import ModelConfig
from kvfleet.fleet.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

EXAMPLE_STD = 0.05  # weights' spread: enough to change SmolLM2's greedy answers, not to garble them


def write_example_adapter(model_dir: Path, out_dir: Path, rank: int = 8, seed: int = 0,
                          targets: tuple[str, ...] = PROJECTIONS) -> Path:
    from safetensors.torch import save_file

    config = ModelConfig.from_dir(model_dir)
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for projection in targets:
            d_in, d_out = shapes[projection]
            part = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) * EXAMPLE_STD
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * EXAMPLE_STD
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS))
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(model_dir)}, indent=2))
    return out_dir
