"""A LoRA adapter in PEFT's format (a directory with adapter_config.json and adapter_model.safetensors), the format
peft writes and vLLM, SGLang and the other engines load, read and checked against the base model before anything
is kept: a client or an operator names the directory, so every field and tensor is hostile until it fits.

An adapter targets some of a Llama layer's projections; each targeted (layer, projection) has A [rank, in] and
B [out, rank], and the layer's output gains `scaling * x @ A.T @ B.T` (kernels/lora.py batches that over a step's
adapters). scaling is lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora, as peft computes it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.engine.model_config import ModelConfig
from kvfleet.fleet.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_CONFIG, ADAPTER_WEIGHTS
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message says what to change."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, projection) -> (A [rank, in], B [out, rank]), in the engine's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features in a Llama layer of this base model."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def parse_adapter_config(raw: object, max_rank: int) -> tuple[int, float, frozenset[str]]:
    """(rank, scaling, targeted projections) from adapter_config.json's object; AdapterError naming the field."""
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {raw.get('peft_type')!r} is not a LoRA adapter (LORA)")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise AdapterError(f"{CONFIG_FILE}: r must be a whole number from 1 to {max_rank} (--max-lora-rank), "
                           f"not {rank!r}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha must be a positive number, not {alpha!r}")
    for field_name, allowed in (("fan_in_fan_out", False), ("use_dora", False), ("bias", "none")):
        if raw.get(field_name, allowed) not in (allowed, None):
            raise AdapterError(f"{CONFIG_FILE}: {field_name}={raw[field_name]!r} is not supported (only {allowed!r})")
    if raw.get("modules_to_save"):
        raise AdapterError(f"{CONFIG_FILE}: modules_to_save (full copies of base layers) is not supported")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(PROJECTIONS)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{CONFIG_FILE}: target_modules must be a list of projection names "
                           f"({', '.join(PROJECTIONS)}) or \"all-linear\"")
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise AdapterError(f"{CONFIG_FILE}: target_modules {unknown} are not projections of a Llama layer "
                           f"({', '.join(PROJECTIONS)})")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") is True else alpha / rank
    return rank, float(scaling), frozenset(targets)


def read_adapter(name: str, directory: Path, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in `directory`, every tensor checked against the base model's shapes before it is kept."""
    try:
        return _read_adapter(name, directory, config, max_rank, dtype)
    except OSError as err:  # unreadable, a name too long, a directory swapped mid-read
        raise AdapterError(f"the adapter {name!r} in {directory} cannot be read: {err.strerror or err}") from None


def _read_adapter(name: str, directory: Path, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    from safetensors import SafetensorError, safe_open

    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"the adapter {name!r} has no {path.name} in {directory}")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} of {name!r} is over {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{CONFIG_FILE} of {name!r} is not JSON: {err}") from None
    except RecursionError:  # a megabyte of nested brackets
        raise AdapterError(f"{CONFIG_FILE} of {name!r} nests too deeply to be an adapter's config") from None
    rank, scaling, targets = parse_adapter_config(raw, max_rank)
    shapes = projection_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"{WEIGHTS_FILE} of {name!r} holds {key!r}, which is not a LoRA weight of a "
                                       "Llama layer's projection")
                layer, projection, which = int(match[1]), match[2], match[3]
                if projection not in targets or layer >= config.num_hidden_layers:
                    raise AdapterError(f"{WEIGHTS_FILE} of {name!r} holds {key!r}, outside its target_modules or "
                                       f"the base model's {config.num_hidden_layers} layers")
                d_in, d_out = shapes[projection]
                expected = (rank, d_in) if which == "A" else (d_out, rank)
                shape = tuple(tensors.get_slice(key).get_shape())
                if shape != expected:
                    raise AdapterError(f"{WEIGHTS_FILE} of {name!r}: {key} is {list(shape)}, this base model "
                                       f"needs {list(expected)}: an adapter made for another base model?")
                parts.setdefault((layer, projection), {})[which] = tensors.get_tensor(key).to(dtype)
    except SafetensorError as err:
        raise AdapterError(f"{WEIGHTS_FILE} of {name!r} is not a readable safetensors file: {err}") from None
    half = sorted(f"layer {layer} {p}" for (layer, p), ab in parts.items() if len(ab) != 2)
    if half:
        raise AdapterError(f"{WEIGHTS_FILE} of {name!r} has lora_A without lora_B (or the reverse) for {half[:3]}")
    if not parts:
        raise AdapterError(f"{WEIGHTS_FILE} of {name!r} holds no LoRA weights")
    return LoraAdapter(name, rank, scaling, {k: (ab["A"], ab["B"]) for k, ab in parts.items()})
