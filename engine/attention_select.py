"""`--attention-backend auto|torch|triton`: which attention backend the engine builds on its device."""

from __future__ import annotations

import importlib.util
import os

import torch

from kvfleet.engine.attention import AttentionBackend, TorchAttentionBackend


def choose_attention_backend(requested: str, device: torch.device, triton_installed: bool,
                             triton_interpreting: bool) -> str:
    """'torch' or 'triton'. auto: Triton on CUDA when installed, torch elsewhere. ValueError says what to change."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_installed else "torch"
    if requested == "triton" and not triton_installed:
        raise ValueError("--attention-backend triton needs the triton package: pip install triton, "
                         "or use --attention-backend torch")
    if requested == "triton" and device.type != "cuda" and not triton_interpreting:
        raise ValueError(f"--attention-backend triton on {device.type} runs only in Triton's interpreter: "
                         "set TRITON_INTERPRET=1 (slow, meant for tests) or use --attention-backend torch")
    return requested


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether TRITON_INTERPRET asks triton to run kernels in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def select_attention_backend(requested: str, device: torch.device) -> str:
    """choose_attention_backend with what this machine has."""
    return choose_attention_backend(requested, device, triton_installed(), triton_interpreting())


def build_attention_backend(name: str, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                            block_size: int, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    backend_class: type[AttentionBackend] = TorchAttentionBackend
    if name == "triton":
        from kvfleet.engine.triton_attention import TritonAttentionBackend

        backend_class = TritonAttentionBackend
    return backend_class(num_layers, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
