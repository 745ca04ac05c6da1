"""The batched multi-LoRA update of kernels/lora.py as two Triton kernels for GPUs (Punica's and vLLM's shrink and
expand): `y[t] += (x[t] @ A[s].T) @ B[s].T` for each token's adapter slot `s = slots[t]` (-1: the base model).

Shrink runs on a grid (token, block of BLOCK_R rank rows) and writes `buffer[t] = x[t] @ A[s].T` in float32, walking
the input dimension BLOCK_K at a time; expand runs on a grid (token, tile of BLOCK_N outputs) and adds
`buffer[t] @ B[s].T` to y[t]. The slots are read on the device, so a step needs no host-side plan and no sync; a
program whose token has slot -1 returns before it loads anything.

Each program takes one token, so its products are matrix-vector products written as broadcast multiplies and
`tl.sum`, not `tl.dot`: tl.dot wants at least 16 rows, which one token cannot give without padding 15 of them (vLLM
sorts tokens by adapter to fill them), and the sums take any rank, 5 as well as 16, by masking alone. Decode steps,
where one token per sequence is the common case, are memory bound on reading A and B either way.

Verified here only in Triton's interpreter (TRITON_INTERPRET=1; this machine has no GPU); the engine's CPU path uses
kernels/lora.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per shrink step
BLOCK_N = 64  # outputs per expand program
MAX_BLOCK_R = 16  # rank rows per shrink program, and per expand step


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    buffer_ptr,
    d_in,
    rank,
    stride_x_token,
    stride_x_in,
    stride_a_slot,
    stride_a_rank,
    stride_a_in,
    stride_slots,
    stride_buffer_token,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token * stride_slots).to(tl.int64)
    if slot < 0:
        return
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rank = ranks < rank
    a_rows = a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank
    x_row = x_ptr + token * stride_x_token
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)  # summed over K once, after the loop
    for start in range(0, d_in, BLOCK_K):
        features = start + tl.arange(0, BLOCK_K)
        in_features = features < d_in
        x = tl.load(x_row + features * stride_x_in, mask=in_features, other=0.0).to(tl.float32)
        a = tl.load(a_rows + features[None, :] * stride_a_in, mask=in_rank[:, None] & in_features[None, :], other=0.0)
        acc += a.to(tl.float32) * x[None, :]
    tl.store(buffer_ptr + token * stride_buffer_token + ranks, tl.sum(acc, axis=1), mask=in_rank)


@triton.jit
def _expand_kernel(
    buffer_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    d_out,
    rank,
    stride_buffer_token,
    stride_b_slot,
    stride_b_out,
    stride_b_rank,
    stride_slots,
    stride_y_token,
    stride_y_out,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token * stride_slots).to(tl.int64)
    if slot < 0:
        return
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_outputs = outputs < d_out
    b_rows = b_ptr + slot * stride_b_slot + outputs[:, None] * stride_b_out
    buffer_row = buffer_ptr + token * stride_buffer_token
    acc = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
    for start in range(0, rank, BLOCK_R):
        ranks = start + tl.arange(0, BLOCK_R)
        in_rank = ranks < rank
        shrunk = tl.load(buffer_row + ranks, mask=in_rank, other=0.0)
        b = tl.load(b_rows + ranks[None, :] * stride_b_rank, mask=in_outputs[:, None] & in_rank[None, :], other=0.0)
        acc += b.to(tl.float32) * shrunk[None, :]
    y = y_ptr + token * stride_y_token + outputs * stride_y_out
    updated = tl.load(y, mask=in_outputs).to(tl.float32) + tl.sum(acc, axis=1)
    tl.store(y, updated.to(y_ptr.dtype.element_ty), mask=in_outputs)


def lora_update_triton(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Adds each token's adapter update to y in place and returns it. y [T, out], x [T, in], a [S, r, in],
    b [S, out, r], slots [T] int32/int64 on y's device (-1: no adapter; others must be < S, unchecked: no sync)."""
    num_tokens, d_out = y.shape
    num_slots, rank, d_in = a.shape
    if x.shape != (num_tokens, d_in) or b.shape != (num_slots, d_out, rank) or slots.shape != (num_tokens,):
        raise ValueError(
            f"LoRA shapes do not match: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}, slots {tuple(slots.shape)}; want y [T, out], x [T, in], "
            "a [S, r, in], b [S, out, r], slots [T]"
        )
    if num_tokens == 0 or rank == 0:
        return y
    block_r = min(triton.next_power_of_2(rank), MAX_BLOCK_R)
    buffer = torch.empty(num_tokens, rank, dtype=torch.float32, device=y.device)  # rows of slot -1 stay unwritten
    _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x,
        a,
        slots,
        buffer,
        d_in,
        rank,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        slots.stride(0),
        buffer.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
    )
    _expand_kernel[(num_tokens, triton.cdiv(d_out, BLOCK_N))](
        buffer,
        b,
        slots,
        y,
        d_out,
        rank,
        buffer.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        slots.stride(0),
        y.stride(0),
        y.stride(1),
        BLOCK_R=block_r,
        BLOCK_N=BLOCK_N,
    )
    return y
