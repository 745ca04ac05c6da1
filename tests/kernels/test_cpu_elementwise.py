"""The CPU elementwise kernels (kernels/cpu_elementwise.py) against the torch operators they replace, and the model's
choice of path: numba for float32 and bfloat16 in CPU memory, torch for everything else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.models.llama import RMSNorm, RotaryEmbedding
from kvfleet.kernels import cpu_elementwise

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_fused_add_and_norm_equals_torchs_and_leaves_the_sum_in_the_residual(rows: int) -> None:
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN) * 3, torch.randn(HIDDEN)
    expected_sum = residual + x
    expected = F.rms_norm(expected_sum, (HIDDEN,), weight, 1e-5)
    out = cpu_elementwise.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.allclose(residual, expected_sum, rtol=0, atol=0)  # the same float32 adds, in place
    assert (out - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert torch.allclose(cpu_elementwise.rms_norm(x, weight, 1e-5), F.rms_norm(x, (HIDDEN,), weight, 1e-5),
                          rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_in_place_equals_the_rotate_half_of_every_q_and_k_head_and_leaves_v(rows: int) -> None:
    torch.manual_seed(rows)
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 100000.0)
    cos, sin = rotary.tables(torch.randint(0, 4096, (rows,)), torch.float32)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k, v = qkv.clone().split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
    cpu_elementwise.rotate_in_place(qkv, cos[:, 0], sin[:, 0], HEADS + KV_HEADS, HEAD_DIM)
    rotated_q = RotaryEmbedding.rotate(q.reshape(rows, HEADS, HEAD_DIM), (cos, sin)).reshape(rows, -1)
    rotated_k = RotaryEmbedding.rotate(k.reshape(rows, KV_HEADS, HEAD_DIM), (cos, sin)).reshape(rows, -1)
    assert torch.allclose(qkv, torch.cat([rotated_q, rotated_k, v], dim=-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_in_bfloat16_the_kernels_round_once_where_torch_rounds_after_every_operator(rows: int) -> None:
    """Against float32 arithmetic on the same bfloat16 inputs: the kernels' error is one bfloat16 rounding of the
    result, never more than torch's own bfloat16 operators; the residual sum is stored as torch's add stores it."""
    torch.manual_seed(rows)
    bf16 = torch.bfloat16
    x, residual, weight = (torch.randn(rows, HIDDEN).to(bf16), (torch.randn(rows, HIDDEN) * 3).to(bf16),
                           torch.randn(HIDDEN).to(bf16))
    stored_sum = residual + x
    exact = F.rms_norm(stored_sum.float(), (HIDDEN,), weight.float(), 1e-5)
    out = cpu_elementwise.add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == bf16 and torch.equal(residual, stored_sum)
    torch_error = (F.rms_norm(stored_sum, (HIDDEN,), weight, 1e-5).float() - exact).abs().max().item()
    assert (out.float() - exact).abs().max().item() <= max(torch_error, 2**-8 * exact.abs().max().item())
    assert torch.equal(cpu_elementwise.rms_norm(stored_sum, weight, 1e-5), out)

    rotary = RotaryEmbedding(HEAD_DIM, 4096, 100000.0)
    cos, sin = rotary.tables(torch.randint(0, 4096, (rows,)), bf16)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(bf16)
    q, k, v = qkv.clone().split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
    cpu_elementwise.rotate_in_place(qkv, cos[:, 0], sin[:, 0], HEADS + KV_HEADS, HEAD_DIM)
    wide = (cos.float(), sin.float())
    exact = torch.cat([RotaryEmbedding.rotate(q.float().reshape(rows, HEADS, HEAD_DIM), wide).reshape(rows, -1),
                       RotaryEmbedding.rotate(k.float().reshape(rows, KV_HEADS, HEAD_DIM), wide).reshape(rows, -1)],
                      dim=-1)
    rotated = qkv[:, :exact.shape[1]].float()
    assert ((rotated - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()  # half a bfloat16 ulp: one rounding
    assert torch.equal(qkv[:, exact.shape[1]:], v)


def test_the_kernels_take_float32_or_bfloat16_cpu_tensors_of_one_dtype_and_the_norm_falls_back_to_torch_otherwise(
) -> None:
    x = torch.randn(4, HIDDEN)
    assert cpu_elementwise.applies(x, torch.randn(HIDDEN))
    assert cpu_elementwise.applies(x.to(torch.bfloat16), torch.randn(HIDDEN).to(torch.bfloat16))
    assert not cpu_elementwise.applies(x.to(torch.bfloat16), torch.randn(HIDDEN))  # mixed dtypes
    assert not cpu_elementwise.applies(x.to(torch.float16))
    assert not cpu_elementwise.applies(torch.randn(HIDDEN, 4).t())  # not contiguous
    norm = RMSNorm(HIDDEN, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN))
    residual = torch.randn(4, HIDDEN)
    half = norm.to(torch.float16)
    out, total = half.add_and_norm(x.to(torch.float16), residual.to(torch.float16))
    assert out.dtype == torch.float16 and total.dtype == torch.float16
    assert torch.equal(total, residual.to(torch.float16) + x.to(torch.float16))  # torch's path: a new tensor
