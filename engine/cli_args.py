"""The engine's command-line flags (vLLM's names) and their mapping onto EngineConfig."""

from __future__ import annotations

import argparse
import os

from kvfleet.engine.api_key import API_KEY_ENV
from kvfleet.engine.config import DTYPES, EngineConfig, parse_size
from kvfleet.engine.model_files import DEFAULT_MODEL


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(err)) from err


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (default) or a local HF-format directory of a Llama-family model")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-num-waiting", type=int, default=1024, help="longest waiting queue before rejecting")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV cache size, bytes or e.g. 512MiB, 2GiB (CPU default 1GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV blocks between requests with a common prefix")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float32 on CPU, bfloat16/float16 on GPU")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require `Authorization: Bearer <key>` on /v1/* (default: ${API_KEY_ENV}; "
                        "/health, /ready and /metrics stay open)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_waiting=args.max_num_waiting,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        dtype=args.dtype, device=args.device, seed=args.seed, attention_backend=args.attention_backend,
        api_key=getattr(args, "api_key", None),
    )
