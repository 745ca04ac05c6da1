"""The Triton LoRA kernels add each token's own adapter's update, as the per-token reference and the torch kernel do,
from a per-token slot tensor; a token of the base model is left exactly as it was. Run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET before triton is imported)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.kernels.lora import lora_update, lora_update_reference, plan_lora  # noqa: E402
from kvfleet.kernels.lora_triton import lora_update_triton  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def adapters(slots: int, rank: int, d_in: int, d_out: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(slots, rank, d_in) / d_in**0.5
    b = torch.randn(slots, d_out, rank) / rank**0.5
    return a.to(dtype), b.to(dtype)


def check_update(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> None:
    """The kernel's result equals the reference's and the torch kernel's; base rows are untouched, others changed."""
    got = lora_update_triton(base.clone(), x, a, b, torch.tensor(slots, dtype=torch.int32))
    tolerance = TOLERANCE[base.dtype]
    torch.testing.assert_close(got, lora_update_reference(base, x, a, b, slots), rtol=tolerance, atol=tolerance)
    plan = plan_lora(slots)
    if plan is not None:
        torch.testing.assert_close(got, lora_update(base.clone(), x, a, b, plan), rtol=tolerance, atol=tolerance)
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(got[base_rows], base[base_rows])
    for row in (~base_rows).nonzero().flatten().tolist():
        assert not torch.allclose(got[row], base[row]), f"token {row} (slot {slots[row]}) got no update"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [16, 5, 20])  # 20: two blocks of rank rows
@pytest.mark.parametrize(
    "slots",
    [
        [2, -1, 0, 2, 1, -1, 0, 2, 3, -1, 1, 0],  # unsorted, with the base model's tokens among them
        [1, 1, 1, 0, 0],  # in runs (a prefill of adapter 1, decodes of adapter 0)
        [3],  # one decode
    ],
)
def test_each_token_gets_its_own_adapters_update(slots: list[int], rank: int, dtype: torch.dtype) -> None:
    torch.manual_seed(len(slots) + rank)
    d_in, d_out = 72, 80  # two blocks of 64 each, the second partly masked
    a, b = adapters(4, rank, d_in, d_out, dtype)
    x = torch.randn(len(slots), d_in).to(dtype)
    check_update(torch.randn(len(slots), d_out).to(dtype), x, a, b, slots)


def test_adapters_of_lower_rank_in_wider_slots_equal_their_own_update() -> None:
    """Adapters of ranks 5 and 3 share a buffer of rank 12: their unused rank rows and columns are zeros."""
    torch.manual_seed(0)
    d_in, d_out, max_rank, ranks = 32, 24, 12, (5, 3)
    a, b = adapters(2, max_rank, d_in, d_out, torch.float32)
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    slots = [1, 0, -1, 0, 1, 0]
    x = torch.randn(len(slots), d_in)
    got = lora_update_triton(torch.zeros(len(slots), d_out), x, a, b, torch.tensor(slots))
    own = torch.stack(
        [
            (x[t] @ a[s, : ranks[s]].T) @ b[s, :, : ranks[s]].T if s >= 0 else torch.zeros(d_out)
            for t, s in enumerate(slots)
        ]
    )
    torch.testing.assert_close(got, own)
    check_update(torch.randn(len(slots), d_out), x, a, b, slots)


def test_a_step_of_the_base_model_alone_leaves_y_as_it_was() -> None:
    torch.manual_seed(1)
    a, b = adapters(2, 16, 32, 24, torch.float32)
    base = torch.randn(4, 24)
    got = lora_update_triton(base.clone(), torch.randn(4, 32), a, b, torch.full((4,), -1))
    assert torch.equal(got, base)


@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "column-major"])
def test_strided_views_give_the_same_update(transposed: bool) -> None:
    """x and y column slices of wider tensors (of row- or column-major storage), a and b transposed views of wider
    slots: the kernels follow their strides, no copies."""
    torch.manual_seed(2)
    d_in, d_out, rank = 48, 40, 8
    slots = [0, -1, 1, 1, 0, 2]

    def wide(columns: int) -> torch.Tensor:
        return torch.randn(columns, len(slots)).T if transposed else torch.randn(len(slots), columns)

    x = wide(d_in + 16)[:, 8 : 8 + d_in]
    a = (torch.randn(3, d_in, rank + 4) / d_in**0.5).transpose(1, 2)[:, :rank]  # rank rows of wider slots
    b = (torch.randn(3, rank + 4, d_out) / rank**0.5).transpose(1, 2)[:, :, :rank]
    assert (a.stride(0), b.stride(0)) == ((rank + 4) * d_in, (rank + 4) * d_out) and not x.is_contiguous()
    check_update(torch.randn(len(slots), d_out), x, a, b, slots)

    wide_y = wide(d_out + 8)
    base = wide_y.clone()
    lora_update_triton(wide_y[:, 4 : 4 + d_out], x, a, b, torch.tensor(slots))
    expected = lora_update_reference(base[:, 4 : 4 + d_out], x, a, b, slots)
    torch.testing.assert_close(wide_y[:, 4 : 4 + d_out], expected)
    assert torch.equal(wide_y[:, :4], base[:, :4]) and torch.equal(wide_y[:, 4 + d_out :], base[:, 4 + d_out :])


def test_mismatched_shapes_say_what_each_should_be() -> None:
    a, b = adapters(2, 4, 32, 24, torch.float32)
    with pytest.raises(ValueError, match=r"want y \[T, out\], x \[T, in\]"):
        lora_update_triton(torch.zeros(3, 24), torch.zeros(3, 16), a, b, torch.zeros(3, dtype=torch.int32))
