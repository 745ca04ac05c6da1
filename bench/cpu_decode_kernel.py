"""The CPU decode attention kernel alone (kernels/cpu_decode_attention.py) at SmolLM2-135M's shapes: 9 query heads,
3 KV heads, head size 64, 16-token blocks, a bfloat16 (or --dtype float32) cache; 64 sequences of 200-272 tokens;
30 calls (one per layer) per round. Prints the median and best round. To compare two versions, run it in each
checkout alternately (the machine drifts), or with NUMBA_CPU_FEATURES set to the host's own features for 256-bit
vectors:

    python -m bench.cpu_decode_kernel --rounds 8
    python -m bench.cpu_decode_kernel --dtype float32 --scattered   # blocks anywhere in the pool, as after reuse
"""

from __future__ import annotations

import argparse
import time

import torch

from kvfleet.kernels.cpu_decode_attention import paged_decode_attention
from kvfleet.kernels.decode_attention import paged_decode_attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="of the KV cache")
    parser.add_argument("--scattered", action="store_true",
                        help="each sequence's blocks anywhere in the pool (a random permutation), not consecutive")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    blocks_per_seq = 272 // BLOCK
    num_blocks = args.sequences * blocks_per_seq + 1
    k = torch.randn(KV_HEADS, num_blocks, BLOCK * HEAD_DIM).to(dtype)
    v = torch.randn(KV_HEADS, num_blocks, BLOCK * HEAD_DIM).to(dtype)
    order = torch.randperm(num_blocks - 1) + 1 if args.scattered else torch.arange(1, num_blocks)
    tables = order.to(torch.int32).view(args.sequences, blocks_per_seq).contiguous()
    lens = torch.randint(200, 273, (args.sequences,), dtype=torch.int32)
    q = torch.randn(args.sequences, HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK, scale)
    error = (out.float() - paged_decode_attention_reference(q.float(), k.float(), v.float(), tables, lens,
                                                            scale)).abs().max().item()
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.layers):
            paged_decode_attention(q, k, v, tables, lens, BLOCK, scale)
        rounds.append((time.perf_counter() - started) * 1000)
    rounds.sort()
    print(f"{args.layers} calls: median {rounds[len(rounds) // 2]:.1f} ms, best {rounds[0]:.1f} ms "
          f"(max difference from the float32 reference {error:.4f})")


if __name__ == "__main__":
    main()
