"""Convert a llama.cpp GGUF file of a Llama-architecture model into a Hugging Face model directory."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.weight")


class GGUFConversionError(ValueError):
    """The GGUF file is not a model this converter understands."""


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a llama.cpp tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match["part"] in _LAYER_NAMES:
        return f"model.layers.{match['layer']}.{_LAYER_NAMES[match['part']]}.weight"
    raise GGUFConversionError(
        f"GGUF tensor {gguf_name!r} has no Llama equivalent; only plain Llama GGUFs "
        "(no RoPE frequency tables, biases or experts) can be converted"
    )


def reverse_rope_permutation(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in q_proj/k_proj rows."""
    head_dim_half = weight.shape[0] // n_head // 2
    per_head = weight.reshape(n_head, head_dim_half, 2, *weight.shape[1:])
    return per_head.swapaxes(2, 1).reshape(weight.shape)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All scalar and string metadata of the file (token tables left out), by key."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(field.data) > 1:
            continue  # token, score and merge tables: the tokenizer converter reads them
        metadata[key] = field.contents()
    metadata["tokenizer.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return metadata


def llama_config(metadata: dict[str, Any], has_output_weight: bool) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from the GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported; convert a model of architecture "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} or pass a Hugging Face model directory"
        )
    hidden_size = int(metadata["llama.embedding_length"])
    n_head = int(metadata["llama.attention.head_count"])
    head_dim = int(metadata.get("llama.attention.key_length", hidden_size // n_head))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": int(metadata["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "intermediate_size": int(metadata["llama.feed_forward_length"]),
        "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(metadata["llama.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(metadata["llama.context_length"]),
        "vocab_size": int(metadata["tokenizer.vocab_size"]),
        "tie_word_embeddings": not has_output_weight,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        gguf_key = "padding_token_id" if key == "pad_token_id" else key
        if f"tokenizer.ggml.{gguf_key}" in metadata:
            config[key] = int(metadata[f"tokenizer.ggml.{gguf_key}"])
    return config


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (float32), tokenizer files and generation_config.json."""
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path)
    has_output_weight = any(t.name == "output.weight" for t in reader.tensors)
    config = llama_config(read_metadata(reader), has_output_weight)

    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", file=sys.stderr):
        name = hf_tensor_name(tensor.name)
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file
        weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, order="C")
        weight = weight.reshape(tuple(reversed(tensor.shape.tolist())))  # GGUF lists dims innermost first
        if name.endswith("q_proj.weight"):
            weight = reverse_rope_permutation(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = reverse_rope_permutation(weight, config["num_key_value_heads"])
        state_dict[name] = torch.from_numpy(np.ascontiguousarray(weight))
    save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state_dict

    _write_json(out_dir / "config.json", config)
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation_config)
    save_tokenizer(gguf_path, out_dir)


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer  # heavy import, only needed while converting

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
