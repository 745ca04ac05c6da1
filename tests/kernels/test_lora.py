"""The batched LoRA update adds each token's own adapter's low-rank update, as the per-token reference does, for any
mix of adapters and the base model in one step; a token of the base model is left exactly as the base GEMM made it."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels.lora import LoraPlan, lora_update, lora_update_reference, plan_lora


def adapters(slots: int, rank: int, d_in: int, d_out: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    a = torch.randn(slots, rank, d_in, dtype=dtype) / d_in**0.5
    b = torch.randn(slots, d_out, rank, dtype=dtype) / rank**0.5
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [
    [0, 0, 0, 0],  # one adapter: views, no gather
    [0, 0, 1, 1, 1, 3],  # already in slot order
    [2, -1, 0, 2, 1, -1, 0, 2],  # a mix, interleaved
    [2, 0, 2, 0, 2, 0, -1, 1],  # scattered: gathered
    [-1, -1, 1, 1],  # the base model's tokens first
    [-1, 0, 0, 2, 2, 0],  # in runs, with a prefill of adapter 0 after the decodes
    [3],  # one token (a decode of one sequence)
])
def test_each_token_gets_its_own_adapters_update(slots: list[int], dtype: torch.dtype) -> None:
    torch.manual_seed(len(slots))
    d_in, d_out, rank = 48, 40, 8
    a, b = adapters(4, rank, d_in, d_out, dtype)
    x = torch.randn(len(slots), d_in, dtype=dtype)
    base = torch.randn(len(slots), d_out, dtype=dtype)
    expected = lora_update_reference(base, x, a, b, slots)
    got = lora_update(base.clone(), x, a, b, plan_lora(slots))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    unchanged = torch.tensor(slots) < 0
    assert torch.equal(got[unchanged], base[unchanged])
    assert not torch.allclose(got[~unchanged], base[~unchanged])  # an adapter's tokens did change


def test_a_step_of_the_base_model_alone_has_no_plan() -> None:
    assert plan_lora([-1, -1, -1]) is None
    assert plan_lora([]) is None


def test_the_plan_groups_each_adapters_tokens_once() -> None:
    plan = plan_lora([2, 0, 2, 0, 2, 0, -1, 1])  # scattered: gathered in slot order
    assert plan.rows.tolist() == [1, 3, 5, 7, 0, 2, 4]
    assert plan.segments == ((0, 0, 3), (1, 3, 4), (2, 4, 7))
    # in runs already (the runner orders decodes by slot): the kernel works on views of the rows, base rows skipped
    assert plan_lora([1, 1, 4]) == LoraPlan(None, ((1, 0, 2), (4, 2, 3)))
    assert plan_lora([-1, -1, 0, 0, 3, 3, 3, 0]) == LoraPlan(None, ((0, 2, 4), (3, 4, 7), (0, 7, 8)))


def test_an_adapter_of_lower_rank_in_a_wider_slot_equals_its_own_update() -> None:
    """Adapters of several ranks share one buffer of the largest: the unused rank rows and columns are zeros."""
    torch.manual_seed(0)
    d_in, d_out, max_rank, rank = 32, 24, 16, 4
    a, b = adapters(1, max_rank, d_in, d_out, torch.float32)
    a[0, rank:] = 0
    b[0, :, rank:] = 0
    x = torch.randn(5, d_in)
    got = lora_update(torch.zeros(5, d_out), x, a, b, plan_lora([0] * 5))
    own = (x @ a[0, :rank].T) @ b[0, :, :rank].T
    torch.testing.assert_close(got, own)
