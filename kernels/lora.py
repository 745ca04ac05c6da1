"""The batched low-rank update of multi-LoRA serving (S-LoRA, Punica): one base GEMM for the whole batch, then each
token's own adapter's update added to its row, `y[t] += (x[t] @ A[s].T) @ B[s].T` for the adapter slot `s = slots[t]`
(-1: the base model, no update). B is stored with the adapter's scaling folded in, as vLLM stores it.

`plan_lora` groups a step's tokens by slot once (every layer reuses the plan); `lora_update` then runs one pair of
GEMMs per run of an adapter's tokens (vLLM's sgmv shrink and expand, vllm/lora/ops/torch_ops), so a step with k
adapters costs about 2k small GEMMs per layer, not two per token. Where each adapter's tokens already lie in a few
runs (the model runner orders a step's decodes by slot) the GEMMs work on views of x and y, with no gather or
scatter; otherwise the tokens are gathered in slot order and their updates scattered back.
`lora_update_reference` is the plain per-token loop it must equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraPlan:
    """A step's tokens grouped by adapter slot: `rows` lists the token rows in slot order, each segment (slot, start,
    end) one adapter's run of them; or rows is None and the segments are runs of the step's own rows."""

    rows: torch.Tensor | None
    segments: tuple[tuple[int, int, int], ...]


def plan_lora(slots: list[int], device: torch.device | str = "cpu") -> LoraPlan | None:
    """The plan for tokens whose adapter slots are `slots` (-1: the base model); None when no token has one."""
    runs = [(slot, start, end) for slot, start, end in _runs(slots) if slot >= 0]
    if not runs:
        return None
    if len(runs) <= 2 * len({slot for slot, _, _ in runs}):  # few runs: views of the rows themselves
        return LoraPlan(None, tuple(runs))
    order = sorted((i for i, slot in enumerate(slots) if slot >= 0), key=slots.__getitem__)
    ordered = [slots[i] for i in order]
    return LoraPlan(torch.tensor(order, dtype=torch.long, device=device), tuple(_runs(ordered)))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal slots: (slot, start, end)."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            runs.append((slots[start], start, i))
            start = i
    return runs


def lora_update(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: LoraPlan) -> torch.Tensor:
    """Adds each planned token's adapter update to y in place and returns it. y [T, out], x [T, in], a [S, r, in],
    b [S, out, r] (a slot's unused rank rows and columns are zeros)."""
    if plan.rows is None:
        for slot, start, end in plan.segments:
            y[start:end].addmm_(x[start:end] @ a[slot].T, b[slot].T)
        return y
    gathered = x.index_select(0, plan.rows)
    delta = torch.empty(len(plan.rows), y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in plan.segments:
        torch.mm(gathered[start:end] @ a[slot].T, b[slot].T, out=delta[start:end])
    return y.index_add_(0, plan.rows, delta)


def lora_update_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          slots: list[int]) -> torch.Tensor:
    out = y.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[t] += b[slot] @ (a[slot] @ x[t])
    return out
