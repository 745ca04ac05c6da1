"""The batched LoRA update adds each token's own adapter's low-rank update, as the per-token reference does, for any
mix of adapters and the base model in one step; a token of the base model is left exactly as the base GEMM made it."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels.lora import lora_update, lora_update_reference


def adapters(slots: int, rank: int, d_in: int, d_out: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    a = torch.randn(slots, rank, d_in, dtype=dtype) / d_in**0.5
    b = torch.randn(slots, d_out, rank, dtype=dtype) / rank**0.5
    return a, b, torch.rand(slots) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [
    [-1, -1, -1],  # the base model alone
    [0, 0, 0, 0],  # one adapter
    [2, -1, 0, 2, 1, -1, 0, 2],  # a mix, interleaved, as a step's decode rows are
    [3],  # one token (a decode of one sequence)
])
def test_each_token_gets_its_own_adapters_update(slots: list[int], dtype: torch.dtype) -> None:
    torch.manual_seed(len(slots))
    d_in, d_out, rank = 48, 40, 8
    a, b, scales = adapters(4, rank, d_in, d_out, dtype)
    x = torch.randn(len(slots), d_in, dtype=dtype)
    base = torch.randn(len(slots), d_out, dtype=dtype)
    index = torch.tensor(slots)
    expected = lora_update_reference(base, x, a, b, index, scales)
    got = lora_update(base.clone(), x, a, b, index, scales)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    unchanged = index < 0
    assert torch.equal(got[unchanged], base[unchanged])
    if (~unchanged).any():  # an adapter's tokens did change
        assert not torch.allclose(got[~unchanged], base[~unchanged])


def test_an_adapter_of_lower_rank_in_a_wider_slot_equals_its_own_update() -> None:
    """Adapters of several ranks share one buffer of the largest: the unused rank rows and columns are zeros."""
    torch.manual_seed(0)
    d_in, d_out, max_rank, rank = 32, 24, 16, 4
    a, b, scales = adapters(1, max_rank, d_in, d_out, torch.float32)
    a[0, rank:] = 0
    b[0, :, rank:] = 0
    x = torch.randn(5, d_in)
    got = lora_update(torch.zeros(5, d_out), x, a, b, torch.zeros(5, dtype=torch.long), scales)
    own = scales[0] * (x @ a[0, :rank].T) @ b[0, :, :rank].T
    torch.testing.assert_close(got, own)


def test_an_empty_step_changes_nothing() -> None:
    a, b, scales = adapters(2, 4, 8, 8, torch.float32)
    y = torch.zeros(0, 8)
    assert lora_update(y, torch.zeros(0, 8), a, b, torch.zeros(0, dtype=torch.long), scales).shape == (0, 8)
