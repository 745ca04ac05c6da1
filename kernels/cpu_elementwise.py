"""The Llama layer's elementwise work on CPUs, compiled by numba: RMSNorm fused with the residual add, and RoPE in
place on the fused q/k/v projection (vLLM's fused_add_rms_norm and rotary_embedding kernels do the same on GPUs).

torch runs each as five to ten separate operators, each a pass over memory and a dispatch: at one token a step the
dispatches cost more than the arithmetic, at 2,048 the passes do (F.rms_norm took ~5 ms and the rotate-half RoPE ~6 ms
per layer for a 2,048-token SmolLM2 step on 2 cores, against ~1 ms each here). float32 and bfloat16 (numpy has no
bfloat16: its raw bits are read as uint16, each row widened to float32, computed, and rounded back to the nearest
bfloat16 once; torch's bfloat16 operators round after every operator: in a 2,048-token bfloat16 prefill they took
~30 % of the step); the model keeps its torch path for other dtypes and devices (`applies`)."""

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


def _widen(bits, out):  # pragma: no cover - compiled by numba
    """out = the bfloat16 row `bits` (raw 16 bits each) as float32: a bfloat16 is a float32's top half."""
    wide = out.view(np.uint32)
    for j in range(bits.shape[0]):
        wide[j] = np.uint32(bits[j]) << np.uint32(16)


def _narrow(values, bits):  # pragma: no cover - compiled by numba
    """bits = the float32 row `values` rounded to the nearest bfloat16, ties to even (as torch's .to(bfloat16))."""
    raw = values.view(np.uint32)
    for j in range(values.shape[0]):
        word = raw[j]
        bits[j] = np.uint16((word + np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _norm_row_bf16(values, wide_weight, eps, scratch, bits):  # pragma: no cover - compiled by numba
    """bits = the float32 row `values` RMS-normalized and scaled by wide_weight, rounded once to bfloat16."""
    squares = np.float32(0.0)
    for j in range(values.shape[0]):
        squares += values[j] * values[j]
    _normalize_row(values, squares, wide_weight, eps, scratch)
    _narrow(scratch, bits)


def _add_rms_norm_bf16(x, residual, weight, eps, out):  # pragma: no cover - compiled by numba
    """_add_rms_norm on bfloat16 bits: the sum is stored rounded to bfloat16 (as torch's bfloat16 add leaves it) and
    normalized as stored; the output is rounded once."""
    rows, size = x.shape
    wide_weight, values, total = np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32)
    _widen(weight, wide_weight)
    for i in range(rows):
        _widen(x[i], values)
        _widen(residual[i], total)
        for j in range(size):
            total[j] += values[j]
        _narrow(total, residual[i])
        _widen(residual[i], total)
        _norm_row_bf16(total, wide_weight, eps, values, out[i])


def _rms_norm_bf16(x, weight, eps, out):  # pragma: no cover - compiled by numba
    rows, size = x.shape
    wide_weight, values, normed = np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32)
    _widen(weight, wide_weight)
    for i in range(rows):
        _widen(x[i], values)
        _norm_row_bf16(values, wide_weight, eps, normed, out[i])


def _rotate_bf16(qkv, cos, sin, heads, head_dim):  # pragma: no cover - compiled by numba
    """_rotate on bfloat16 bits, each rotated head rounded once."""
    half = head_dim // 2
    wide_cos, wide_sin = np.empty(half, np.float32), np.empty(half, np.float32)
    head, rotated = np.empty(head_dim, np.float32), np.empty(head_dim, np.float32)
    for i in range(qkv.shape[0]):
        _widen(cos[i], wide_cos)
        _widen(sin[i], wide_sin)
        for h in range(heads):
            row = qkv[i, h * head_dim:(h + 1) * head_dim]
            _widen(row, head)
            for j in range(half):
                rotated[j] = head[j] * wide_cos[j] - head[half + j] * wide_sin[j]
                rotated[half + j] = head[half + j] * wide_cos[j] + head[j] * wide_sin[j]
            _narrow(rotated, row)


# compiled in order: the kernels call the helpers by their global names
_normalize_row = compile_kernel(_normalize_row, inline="always")
_widen = compile_kernel(_widen, inline="always")
_narrow = compile_kernel(_narrow, inline="always")
_norm_row_bf16 = compile_kernel(_norm_row_bf16, inline="always")
_add_rms_norm = compile_kernel(_add_rms_norm)
_rms_norm = compile_kernel(_rms_norm)
_rotate = compile_kernel(_rotate)
_add_rms_norm_bf16 = compile_kernel(_add_rms_norm_bf16)
_rms_norm_bf16 = compile_kernel(_rms_norm_bf16)
_rotate_bf16 = compile_kernel(_rotate_bf16)
DTYPES = (torch.float32, torch.bfloat16)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these kernels can take the tensors: all float32 or all bfloat16, contiguous, in CPU memory."""
    return (tensors[0].dtype in DTYPES
            and all(t.device.type == "cpu" and t.dtype == tensors[0].dtype and t.is_contiguous() for t in tensors))


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor as numba reads it: float32 as is, bfloat16 as its raw 16 bits (numpy has no bfloat16)."""
    return t.detach().view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(residual + x) [T, hidden]; the sum is left in `residual` (in place) for the next residual add."""
    out = torch.empty_like(x)
    kernel = _add_rms_norm_bf16 if x.dtype == torch.bfloat16 else _add_rms_norm
    kernel(_raw(x), _raw(residual), _raw(weight), np.float32(eps), _raw(out))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel = _rms_norm_bf16 if x.dtype == torch.bfloat16 else _rms_norm
    kernel(_raw(x), _raw(weight), np.float32(eps), _raw(out))
    return out


def rotate_in_place(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first `heads` heads of qkv [T, width] in place by the positions cos and sin [T, D/2] belong to."""
    kernel = _rotate_bf16 if qkv.dtype == torch.bfloat16 else _rotate
    kernel(_raw(qkv), _raw(cos), _raw(sin), heads, head_dim)
