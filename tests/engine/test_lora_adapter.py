"""A PEFT-format LoRA adapter is read and checked against the base model before anything is kept: its update on a
projection equals the projection with the adapter merged into its weight (what peft's merge_and_unload computes),
and every hostile or mismatched adapter is an AdapterError that names what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvfleet.engine.lora_adapter import AdapterError, projection_shapes, read_adapter
from kvfleet.engine.model_config import ModelConfig
from kvfleet.kernels.lora import lora_update, plan_lora

BASE = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=256)
PREFIX = "base_model.model.model.layers"


def key(layer: int, projection: str, which: str) -> str:
    part = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{part}.{projection}.lora_{which}.weight"


def write_adapter(directory: Path, rank: int = 4, targets=("q_proj", "v_proj", "down_proj"), config: dict | None = None,
                  tensors: dict | None = None, base: ModelConfig = BASE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shapes = projection_shapes(base)
    if tensors is None:
        tensors = {}
        for layer in range(base.num_hidden_layers):
            for p in targets:
                d_in, d_out = shapes[p]
                tensors[key(layer, p, "A")] = torch.randn(rank, d_in)
                tensors[key(layer, p, "B")] = torch.randn(d_out, rank)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
            "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": "tiny", **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(body))
    return directory


def test_the_update_equals_the_projection_with_the_adapter_merged_in(tmp_path: Path) -> None:
    torch.manual_seed(0)
    adapter = read_adapter("sql", write_adapter(tmp_path / "sql"), BASE, max_rank=16, dtype=torch.float32)
    assert adapter.rank == 4 and adapter.scaling == 2.0 and len(adapter.weights) == 2 * 3
    a, b = adapter.weights[(1, "down_proj")]
    weight = torch.randn(BASE.hidden_size, BASE.intermediate_size)  # the base projection, [out, in]
    merged = weight + adapter.scaling * b @ a  # peft's merge
    x = torch.randn(5, BASE.intermediate_size)
    got = lora_update(x @ weight.T, x, a[None], adapter.scaling * b[None], plan_lora([0] * 5))
    torch.testing.assert_close(got, x @ merged.T, rtol=1e-4, atol=1e-4)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path) -> None:
    adapter = read_adapter("r", write_adapter(tmp_path / "r", rank=16, config={"use_rslora": True, "lora_alpha": 8}),
                           BASE, max_rank=16, dtype=torch.bfloat16)
    assert adapter.scaling == 2.0 and all(a.dtype == torch.bfloat16 for a, _ in adapter.weights.values())


@pytest.mark.parametrize(("change", "says"), [
    (dict(config={"r": 64}), "r must be a whole number from 1 to 16"),
    (dict(config={"r": "4"}), "r must be"),
    (dict(config={"lora_alpha": float("nan")}), "lora_alpha must be a positive number"),
    (dict(config={"peft_type": "PREFIX_TUNING"}), "is not a LoRA adapter"),
    (dict(config={"use_dora": True}), "use_dora"),
    (dict(config={"fan_in_fan_out": True}), "fan_in_fan_out"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"target_modules": ["q_proj", "c_attn"]}), "['c_attn'] are not projections of a Llama layer"),
    (dict(config={"target_modules": ".*proj"}), "target_modules must be a list"),
    # made for a base model with another width: A's in-features do not fit
    (dict(base=ModelConfig(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=256)),
     "an adapter made for another base model"),
    (dict(tensors={key(0, "q_proj", "A"): torch.randn(4, 64)}), "lora_A without lora_B"),
    (dict(tensors={key(5, "q_proj", "A"): torch.randn(4, 64), key(5, "q_proj", "B"): torch.randn(64, 4)}),
     "the base model's 2 layers"),
    (dict(tensors={"base_model.model.lm_head.weight": torch.randn(100, 64)}), "not a LoRA weight"),
    (dict(tensors={}), "holds no LoRA weights"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_what_to_change(tmp_path: Path, change: dict,
                                                                       says: str) -> None:
    directory = write_adapter(tmp_path / "bad", **change)
    with pytest.raises(AdapterError) as refused:
        read_adapter("bad", directory, BASE, max_rank=16, dtype=torch.float32)
    assert says in str(refused.value)


@pytest.mark.parametrize("damage", ["truncated header", "truncated data", "garbage", "json", "nested json",
                                    "missing"])
def test_a_corrupt_or_missing_file_is_refused(tmp_path: Path, damage: str) -> None:
    directory = write_adapter(tmp_path / "bad")
    weights, config = directory / "adapter_model.safetensors", directory / "adapter_config.json"
    if damage == "truncated header":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "truncated data":
        weights.write_bytes(weights.read_bytes()[:-500])
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif damage == "json":
        config.write_text("{not json")
    elif damage == "nested json":
        config.write_text("[" * 200_000 + "]" * 200_000)
    else:
        weights.unlink()
    with pytest.raises(AdapterError):
        read_adapter("bad", directory, BASE, max_rank=16, dtype=torch.float32)
