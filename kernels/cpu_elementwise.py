"""The Llama layer's elementwise work on CPUs, compiled by numba: RMSNorm fused with the residual add, and RoPE in
place on the fused q/k/v projection (vLLM's fused_add_rms_norm and rotary_embedding kernels do the same on GPUs).

torch runs each as five to ten separate operators, each a pass over memory and a dispatch: at one token a step the
dispatches cost more than the arithmetic, at 2,048 the passes do (F.rms_norm took ~5 ms and the rotate-half RoPE ~6 ms
per layer for a 2,048-token SmolLM2 step on 2 cores, against ~1 ms each here). float32 only; the model keeps its torch
path for other dtypes and devices (`applies`)."""

from __future__ import annotations

import numpy as np
import torch

from kvfleet.kernels.numba_build import compile_kernel


def _normalize_row(values, squares, weight, eps, out):  # pragma: no cover - compiled by numba
    """out = weight * values / sqrt(mean(values ** 2) + eps) for one row whose squares are summed (HF's order: the
    normalized row, then the weight)."""
    scale = np.float32(1.0) / np.sqrt(squares / np.float32(values.shape[0]) + eps)
    for j in range(values.shape[0]):
        out[j] = weight[j] * (values[j] * scale)


def _add_rms_norm(x, residual, weight, eps, out):  # pragma: no cover - compiled by numba
    """residual += x, then each row of out is RMSNorm(residual)."""
    rows, size = x.shape
    for i in range(rows):
        squares = np.float32(0.0)
        for j in range(size):
            total = residual[i, j] + x[i, j]
            residual[i, j] = total
            squares += total * total
        _normalize_row(residual[i], squares, weight, eps, out[i])


def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled by numba
    rows, size = x.shape
    for i in range(rows):
        squares = np.float32(0.0)
        for j in range(size):
            squares += x[i, j] * x[i, j]
        _normalize_row(x[i], squares, weight, eps, out[i])


def _rotate(qkv, cos, sin, heads, head_dim):  # pragma: no cover - compiled by numba
    """The first `heads` heads of each row of qkv [T, width] rotated in place (rotate-half RoPE): cos, sin [T, D/2]."""
    half = head_dim // 2
    for i in range(qkv.shape[0]):
        for h in range(heads):
            first = h * head_dim
            for j in range(half):
                x1 = qkv[i, first + j]
                x2 = qkv[i, first + half + j]
                qkv[i, first + j] = x1 * cos[i, j] - x2 * sin[i, j]
                qkv[i, first + half + j] = x2 * cos[i, j] + x1 * sin[i, j]


# compiled in order: the norms call the helper by its global name
_normalize_row = compile_kernel(_normalize_row, inline="always")
_add_rms_norm = compile_kernel(_add_rms_norm)
_rms_norm = compile_kernel(_rms_norm)
_rotate = compile_kernel(_rotate)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these kernels can take the tensors: float32, contiguous, in CPU memory."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(residual + x) [T, hidden]; the sum is left in `residual` (in place) for the next residual add."""
    out = torch.empty_like(x)
    _add_rms_norm(x.numpy(), residual.numpy(), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _rms_norm(x.numpy(), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out


def rotate_in_place(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first `heads` heads of qkv [T, width] in place by the positions cos and sin [T, D/2] belong to."""
    _rotate(qkv.numpy(), cos.numpy(), sin.numpy(), heads, head_dim)
