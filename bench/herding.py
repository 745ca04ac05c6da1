"""Herding: do gateway replicas that read the same scrapes pile a burst onto the same engines? (issue 15, item 4)

    python -m bench.herding --engines 4 --replicas 1,2,4 --burst 48 --out bench/results
    python -m bench.herding --quick

Real engines (the tiny random Llama by default, one torch thread each) behind 1, 2 and 4 gateway replicas sharing one
Redis. A burst of distinct prompts (no shared prefix: only load should spread them) is sent at once, dealt to the
replicas in turn; each answer's `x-kvfleet-engine` says where it went. Herding index = in each 100 ms window of
sends, the busiest engine's arrivals over the mean per engine (1.0: perfectly even; E: all on one of E engines),
averaged over the windows weighted by their arrivals. Per strategy and replica count, side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from bench.fleet_procs import MODEL_NAME, BenchFleet, model_dir
from kvfleet.gateway.routing.strategies import PREFIX_STRATEGIES

WINDOW_S = 0.1
WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "glade", "harbor", "iris", "juniper", "kelp", "lumen")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--routing", default="kvfleet,estimated-ttft,least-request")
    p.add_argument("--burst", type=int, default=48, help="requests sent at once")
    p.add_argument("--bursts", type=int, default=3, help="bursts per arm (the engines idle in between)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.quick:
        args.burst, args.bursts, args.replicas = 16, 1, "1,2"
    return args


def prompt(i: int) -> str:
    """A distinct prompt from its first characters on (no prefix in common with the others)."""
    return " ".join(f"{WORDS[(i * 7 + k) % len(WORDS)]}{i}-{k}" for k in range(24))


def herding_index(sends: list[tuple[float, str]], engines: list[str]) -> float:
    """Arrival-weighted mean over 100 ms windows of (busiest engine's arrivals / mean arrivals per engine)."""
    if not sends:
        return float("nan")
    start = min(t for t, _ in sends)
    windows: dict[int, Counter] = defaultdict(Counter)
    for t, engine in sends:
        windows[int((t - start) / WINDOW_S)][engine] += 1
    total = weighted = 0.0
    for counts in windows.values():
        n = sum(counts.values())
        weighted += n * max(counts.values()) / (n / len(engines))
        total += n
    return weighted / total


async def burst(gateways: list[str], size: int, offset: int, max_tokens: int) -> list[tuple[float, str]]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=size)) as client:
        async def one(i: int) -> tuple[float, str]:
            body = {"model": MODEL_NAME, "prompt": prompt(offset + i), "max_tokens": max_tokens, "ignore_eos": True}
            sent = time.monotonic()
            reply = await client.post(f"{gateways[i % len(gateways)]}/v1/completions", json=body)
            reply.raise_for_status()
            return sent, reply.headers["x-kvfleet-engine"]
        return list(await asyncio.gather(*(one(i) for i in range(size))))


def main() -> None:
    args = parse_args()
    replicas = [int(r) for r in args.replicas.split(",")]
    strategies = args.routing.split(",")
    results: list[dict] = []
    with BenchFleet(model=args.model, max_num_seqs=[args.max_num_seqs] * args.engines) as fleet:
        engines = [e.url for e in fleet.engines]
        tokenizer = ["--tokenizer", str(model_dir(args.model))]
        offset = 0
        for routing in strategies:
            for n in replicas:
                fleet.stop_gateway()
                urls = [fleet.start_gateway(routing, extra=tokenizer if routing in PREFIX_STRATEGIES else [],
                                            alongside=True) for _ in range(n)]
                sends: list[tuple[float, str]] = []
                indices = []
                for _ in range(args.bursts):
                    got = asyncio.run(burst(urls, args.burst, offset, args.max_tokens))
                    offset += args.burst
                    indices.append(herding_index(got, engines))
                    sends += got
                    fleet.wait_idle(settle_s=0.5)
                share = Counter(e for _, e in sends)
                row = {"routing": routing, "replicas": n, "herding_index": sum(indices) / len(indices),
                       "per_burst": indices, "per_engine": [share.get(e, 0) for e in engines]}
                results.append(row)
                print(f"{routing:15s} replicas={n}  herding index {row['herding_index']:.2f} "
                      f"(bursts {', '.join(f'{i:.2f}' for i in indices)})  per engine {row['per_engine']}",
                      flush=True)
        fleet.stop_gateway()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"herding-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"command": shlex.join(["python", "-m", "bench.herding", *sys.argv[1:]]),
                               "engines": args.engines, "burst": args.burst, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
