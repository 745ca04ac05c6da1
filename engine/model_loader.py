"""Builds the model and its attention backend on a device and loads the weights from safetensors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvfleet.engine.attention import AttentionBackend
from kvfleet.engine.attention_select import build_attention_backend
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.packed_linear import can_pack, pack_linears
from kvfleet.fleet.cpu_features import auto_cpu_dtype, host_cpu_flags

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


# torch.nn.init's random fills, which nn.Linear and nn.Embedding call when they are built
_INIT_FILLS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
               "trunc_normal_")
_init_patch = threading.Lock()


@contextmanager
def _initialization_skipped() -> Iterator[None]:
    """Modules built inside leave their weights uninitialized (torch.empty): every weight is read from the checkpoint
    next, and load_weights refuses a checkpoint that leaves any parameter unset. A random init only to be
    overwritten was 1.0-1.3 s of a 135M model's start; building on the meta device instead ran torch's Python reference
    ops, whose first use imports torch._dynamo (2 s). The same patch as transformers' no_init_weights; held under a
    lock, so engines built by threads of one process never restore each other's no-ops."""
    with _init_patch:
        saved = {name: getattr(nn.init, name) for name in _INIT_FILLS}
        for name in _INIT_FILLS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fill in saved.items():
                setattr(nn.init, name, fill)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    return resolve_dtype(name, device)[0]


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in and why (the start-up log says both). auto: on a CPU, bfloat16 where it has bfloat16
    instructions, else float32 (kvfleet/fleet/cpu_features.py); on a GPU, bfloat16 where it has it, else float16."""
    if name != "auto":
        return _DTYPES[name], "asked for"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: this GPU runs bfloat16"
        return torch.float16, "auto: this GPU has no bfloat16"
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    chosen, why = auto_cpu_dtype(host_cpu_flags(), onednn_bf16)
    return _DTYPES[chosen], f"auto: {why}"


def iter_safetensors(model_dir: Path, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    names = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.extend((file, key) for key in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    progress = tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not show_progress,
                    leave=False)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                yield key, f.get_tensor(key)
                progress.update()
    progress.close()


def load_model(model_dir: Path, config: ModelConfig, block_size: int, max_positions: int,
               dtype: torch.dtype, device: torch.device, attention_backend: str,
               show_progress: bool = True) -> tuple[LlamaForCausalLM, AttentionBackend]:
    backend = build_attention_backend(
        attention_backend, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
        config.head_dim, block_size, dtype, device,
    )
    with torch.device(device), _initialization_skipped():
        model = LlamaForCausalLM(config, backend, max_positions)
    model.to(dtype)
    model.load_weights(iter_safetensors(model_dir, show_progress))
    model.eval().requires_grad_(False)
    if can_pack(device, dtype):
        if model.lm_head is None:
            model.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
            model.lm_head.weight = model.embed_tokens.weight
        log.info("CPU GEMMs: %d linear layers prepacked for oneDNN", pack_linears(model))
    return model, backend
