"""Decode attention per layer: the Triton backend beside the torch backend (and FlashInfer when installed).

    python -m bench.kernels --out bench/results      # CUDA: batch 1-256 x context 128-8192
    python -m bench.kernels                          # CPU: one tiny size in Triton's interpreter, so it cannot rot

Each backend runs a decode step of one layer (write the new K/V rows, attend over the paged context) on the same
inputs; FlashInfer's BatchDecodeWithPagedKVCacheWrapper attends over a copy of the cache in its own layout.
Bandwidth counts the bytes a decode step must move: every sequence's K and V rows, plus q and the output.
On CUDA it is reported as a share of --peak-gbs (the H100 SXM's 3,350 GB/s by default); the issue's target is
>= 70% for batch >= 64 and context >= 1024. The default layer is Llama-3-8B's (32 query heads, 8 KV heads of 128).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvfleet.engine.attention import AttentionMetadata, DecodeGroup, TorchAttentionBackend

if TYPE_CHECKING:
    from kvfleet.engine.triton_attention import TritonAttentionBackend

BATCHES = (1, 4, 16, 64, 128, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)


@dataclass
class Shape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_moved(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        kv = 2 * self.batch * self.context * self.num_kv_heads * self.head_dim
        return (kv + 2 * self.batch * self.num_heads * self.head_dim) * element


@dataclass
class Row:
    batch: int
    context: int
    triton_ms: float
    torch_ms: float
    flashinfer_ms: float | None
    triton_gbs: float
    speedup_vs_torch: float
    max_abs_diff: float  # between the Triton and torch backends' outputs


def decode_step(shape: Shape, device: torch.device) -> tuple[TorchAttentionBackend, TritonAttentionBackend, tuple]:
    """Both backends over one shared cache, and forward's arguments: layer 0, q, k, v, decode-only metadata."""
    from kvfleet.engine.triton_attention import TritonAttentionBackend

    blocks_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq + 1
    args = (1, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size, shape.dtype, device)
    torch_backend, triton_backend = TorchAttentionBackend(*args), TritonAttentionBackend(*args)
    torch_backend.allocate_kv_cache(num_blocks)
    torch_backend.kv_cache.normal_()
    triton_backend.kv_cache = torch_backend.kv_cache
    tables = (torch.randperm(num_blocks - 1, device=device)[: shape.batch * blocks_per_seq] + 1)
    tables = tables.view(shape.batch, blocks_per_seq)
    seq_lens = torch.full((shape.batch,), shape.context, device=device)
    last = shape.context - 1
    slots = tables[:, last // shape.block_size] * shape.block_size + last % shape.block_size
    group = DecodeGroup(0, shape.batch, tables, seq_lens, shape.block_size, shape.dtype)
    group.mask  # noqa: B018 - built once here, outside the timed calls, as the engine builds it once per step
    meta = AttentionMetadata(slots, shape.batch, [group], [], [], [])
    q = torch.randn(shape.batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    k = torch.randn(shape.batch, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
    v = torch.randn_like(k)
    return torch_backend, triton_backend, (0, q, k, v, meta)


def flashinfer_decode(shape: Shape, backend: TorchAttentionBackend, inputs: tuple
                      ) -> Callable[[], torch.Tensor] | None:
    """FlashInfer's paged decode over a copy of the cache in its HND layout; None when it is not installed."""
    try:
        import flashinfer
    except ImportError:
        return None
    _, q, _, _, meta = inputs
    group = meta.decode_groups[0]
    device = q.device
    pages = backend.kv_cache[0].unflatten(-1, (shape.block_size, shape.head_dim))  # [2, KVH, blocks, bs, D]
    k_pages, v_pages = (pages[i].transpose(0, 1).contiguous() for i in range(2))
    blocks_per_seq = group.block_tables.shape[1]
    indptr = torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * blocks_per_seq
    last_page_len = torch.full((shape.batch,), (shape.context - 1) % shape.block_size + 1, dtype=torch.int32,
                               device=device)
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    wrapper.plan(indptr, group.block_tables.flatten().int(), last_page_len, shape.num_heads, shape.num_kv_heads,
                 shape.head_dim, shape.block_size, q_data_type=shape.dtype, kv_data_type=shape.dtype,
                 sm_scale=shape.head_dim**-0.5)
    return lambda: wrapper.run(q, (k_pages, v_pages))


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn()  # the interpreter's first call sets up; time the second
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(shape: Shape, device: torch.device) -> Row:
    torch_backend, triton_backend, inputs = decode_step(shape, device)
    diff = (triton_backend.forward(*inputs).float() - torch_backend.forward(*inputs).float()).abs().max().item()
    triton_ms = time_ms(lambda: triton_backend.forward(*inputs), device)
    torch_ms = time_ms(lambda: torch_backend.forward(*inputs), device)
    flashinfer = flashinfer_decode(shape, torch_backend, inputs) if device.type == "cuda" else None
    flashinfer_ms = time_ms(flashinfer, device) if flashinfer else None
    return Row(shape.batch, shape.context, triton_ms, torch_ms, flashinfer_ms,
               shape.bytes_moved() / triton_ms / 1e6, torch_ms / triton_ms, diff)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="on CUDA")
    parser.add_argument("--peak-gbs", type=float, default=3350.0, help="the GPU's memory bandwidth, GB/s")
    parser.add_argument("--out", type=Path, help="folder for kernels.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        # Triton reads this when first imported, which the backends do below.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    sizes = [(b, c) for b in BATCHES for c in CONTEXTS] if cuda else [(2, 128)]
    torch.manual_seed(0)
    print(f"{device}, {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, block {args.block_size}, "
          f"{dtype}" + ("" if cuda else " (Triton interpreter: times say nothing about a GPU)"))
    print(f"{'batch':>5} {'ctx':>5} {'triton ms':>10} {'GB/s':>8} {'% peak':>7} {'torch ms':>9} {'x torch':>8} "
          f"{'flashinfer ms':>13} {'max diff':>9}")
    rows = []
    for batch, context in sizes:
        shape = Shape(batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
        row = measure(shape, device)
        rows.append(row)
        peak = f"{100 * row.triton_gbs / args.peak_gbs:6.1f}%" if cuda else f"{'-':>7}"
        flashinfer = f"{row.flashinfer_ms:13.3f}" if row.flashinfer_ms is not None else f"{'-':>13}"
        print(f"{batch:5d} {context:5d} {row.triton_ms:10.3f} {row.triton_gbs:8.1f} {peak} {row.torch_ms:9.3f} "
              f"{row.speedup_vs_torch:7.2f}x {flashinfer} {row.max_abs_diff:9.2e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"device": str(device), "dtype": str(dtype), "args": {k: str(v) for k, v in vars(args).items()},
                  "rows": [asdict(r) for r in rows]}
        (args.out / "kernels.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
