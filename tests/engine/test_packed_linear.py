"""oneDNN-prepacked linear layers (engine/packed_linear.py) compute what nn.Linear does, in float32 and, where the CPU
has bfloat16 instructions, in bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.packed_linear import PackedLinear, can_pack, pack_linears

CPU = torch.device("cpu")
BF16_ON_THIS_CPU = can_pack(CPU, torch.bfloat16)


@pytest.mark.parametrize("rows", (1, 16, 300))
def test_a_packed_float32_layer_computes_the_linear_layers_answer(rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    assert can_pack(CPU, torch.float32)
    assert torch.allclose(PackedLinear(weight, bias)(x), F.linear(x, weight, bias), atol=1e-4)


def test_float16_and_other_devices_are_not_packed() -> None:
    assert not can_pack(CPU, torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)


@pytest.mark.skipif(not BF16_ON_THIS_CPU, reason="this CPU has no bfloat16 instructions (AVX-512 BF16 or AMX)")
@pytest.mark.parametrize("rows", (1, 16, 300))
def test_a_packed_bfloat16_layer_computes_the_linear_layers_answer(rows: int) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(rows, 64).bfloat16()
    packed = PackedLinear(weight, None)(x)
    assert packed.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float())
    assert (packed.float() - expected).abs().max().item() <= 0.02 * expected.abs().max().item()


@pytest.mark.skipif(not BF16_ON_THIS_CPU, reason="this CPU has no bfloat16 instructions (AVX-512 BF16 or AMX)")
def test_every_linear_layer_of_a_bfloat16_module_is_packed() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4))).bfloat16()
    x = torch.randn(5, 8).bfloat16()
    expected = module(x)
    assert pack_linears(module) == 2
    assert all(not isinstance(m, torch.nn.Linear) for m in module.modules())
    assert (module(x).float() - expected.float()).abs().max().item() <= 0.05
