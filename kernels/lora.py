"""The batched low-rank update of multi-LoRA serving (S-LoRA, Punica): one base GEMM for the whole batch, then each
token's own adapter's update added to its row, `y[t] += scale[s] * (x[t] @ A[s].T) @ B[s].T` for the adapter slot
`s = slots[t]` (-1: the base model, no update).

`lora_update` is the CPU path: the tokens of each adapter in the step gathered into one pair of GEMMs (vLLM's
sgmv shrink and expand, vllm/lora/ops/torch_ops), so a step with k adapters costs 2k small GEMMs, not two per token.
`lora_update_reference` is the plain per-token loop it must equal."""

from __future__ import annotations

import torch


def lora_update(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """Adds each token's adapter update to y in place and returns it. y [T, out], x [T, in], a [S, r, in],
    b [S, out, r] (a slot's unused rank rows and columns are zeros), slots [T] (-1: none), scales [S]."""
    if slots.numel() == 0:
        return y
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        shrunk = x.index_select(0, rows) @ a[slot].T
        y.index_add_(0, rows, (shrunk @ b[slot].T) * scales[slot].to(y.dtype))
    return y


def lora_update_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                          scales: torch.Tensor) -> torch.Tensor:
    out = y.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += scales[slot].to(y.dtype) * (b[slot] @ (a[slot] @ x[t]))
    return out
