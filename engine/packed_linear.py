"""oneDNN-packed linear layers for CPUs (float32, bfloat16): weights are reordered once at load, not on every GEMM.

Plain `F.linear` repacks the weight inside every call, which dominates at decode batch sizes;
a prepacked weight runs those GEMMs about twice as fast (bench/engine_throughput.py).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 16  # the GEMM rows oneDNN tunes the packed layout for; it stays fast from 8 to 2048 rows


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 wherever oneDNN is built in; bfloat16 where the CPU has bfloat16 instructions (AVX-512 BF16 or AMX):
    prepacked bfloat16 GEMMs ran 1.8-2x the float32 ones at 1-64 rows on this project's machine."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """Swap every nn.Linear under module for a PackedLinear; returns how many were swapped."""
    swapped = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            swapped += 1
        else:
            swapped += pack_linears(child)
    return swapped
