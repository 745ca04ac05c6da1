"""The batched low-rank update of multi-LoRA serving (S-LoRA, Punica): one base GEMM for the whole batch, then each
token's own adapter's update added to its row, `y[t] += (x[t] @ A[s].T) @ B[s].T` for the adapter slot `s = slots[t]`
(-1: the base model, no update). B is stored with the adapter's scaling folded in, as vLLM stores it.

`plan_lora` sorts a step's tokens by slot once (every layer reuses the plan); `lora_update` then runs one pair of
GEMMs per adapter in the step over its run of tokens (vLLM's sgmv shrink and expand, vllm/lora/ops/torch_ops), so a
step with k adapters costs 2k small GEMMs per layer, not two per token. When the step's tokens are already in slot
order (one adapter, or the batch was formed that way) they are views, with no gather or scatter.
`lora_update_reference` is the plain per-token loop it must equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraPlan:
    """A step's tokens grouped by adapter slot: `rows` lists the token rows in slot order (None: every row, in
    order), and each segment (slot, start, end) is one adapter's run of them."""

    rows: torch.Tensor | None
    segments: tuple[tuple[int, int, int], ...]


def plan_lora(slots: list[int], device: torch.device | str = "cpu") -> LoraPlan | None:
    """The plan for tokens whose adapter slots are `slots` (-1: the base model); None when no token has one."""
    order = sorted((i for i, slot in enumerate(slots) if slot >= 0), key=slots.__getitem__)
    if not order:
        return None
    segments: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(order) + 1):
        if i == len(order) or slots[order[i]] != slots[order[start]]:
            segments.append((slots[order[start]], start, i))
            start = i
    in_order = len(order) == len(slots) and all(i == row for i, row in enumerate(order))
    rows = None if in_order else torch.tensor(order, dtype=torch.long, device=device)
    return LoraPlan(rows, tuple(segments))


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
