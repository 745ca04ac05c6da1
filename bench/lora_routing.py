"""Routing by LoRA adapter: 32 adapters over 2 engines that each hold 8 at a time, kvfleet's adapter affinity against
least-request (issue 38's target: mean TTFT <= 0.7x least-request's; adapter loads per 1,000 requests for both).

    python -m bench.lora_routing --json docs/benchmarks/lora_routing.json

Two `kvfleet engine`s of SmolLM2-135M-Instruct, each serving the same 32 rank-16 adapters (`kvfleet lora example`,
seeds 0-31) with --max-loras 8 (adapters in one batch) and --max-cpu-loras 8 (adapters kept read in host memory; the
rest are read again from disk when a request needs them), behind a fresh `kvfleet gateway` per policy, the engines
restarted between policies (empty caches). The same seeded open-loop workload for both: Poisson arrivals, each
request for one of the adapters (uniform, or --zipf S for a skewed popularity), chat prompts of 48 words, 32 output
tokens, EOS ignored. Reports TTFT mean/p50/p90/p99, end-to-end mean, and adapter reads from disk and slot loads per
1,000 requests, from the engines' counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.fleet_procs import latency_stats, model_dir, spawn, wait_for
from kvfleet.engine.lora_example import write_example_adapter
from kvfleet.fleet import metrics as names
from kvfleet.fleet.engine_settings import EngineSettings
from kvfleet.fleet.ports import free_port
from kvfleet.loadgen import LoadSpec, run_load
from kvfleet.local.redis_server import RedisServer

ADAPTERS, HELD, RANK = 32, 8, 16
POLICIES = ("least-request", "kvfleet")
COUNTERS = (names.LORA_ADAPTER_READS, names.LORA_SLOT_LOADS)
TARGET = 0.7  # kvfleet's mean TTFT / least-request's


def engine_args(model: Path, port: int, adapters: dict[str, Path], seqs: int) -> list[str]:
    settings = EngineSettings(model=str(model), max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=seqs)
    return ["engine", *settings.to_args(), "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
            "--max-loras", str(HELD), "--max-cpu-loras", str(HELD), "--max-lora-rank", str(RANK),
            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]


def counters(urls: list[str]) -> dict[str, float]:
    total = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            for name in COUNTERS:
                if line.startswith(f"{name}_total "):
                    total[name] += float(line.split()[1])
    return total


def run_policy(policy: str, args: argparse.Namespace, model: Path, adapters: dict[str, Path], work: Path) -> dict:
    redis = RedisServer().start()
    engines, gateway = [], None
    try:
        for i in range(2):
            port = free_port()
            engines.append(spawn(f"{policy}-engine-{i}", engine_args(model, port, adapters, args.max_num_seqs),
                                 f"http://127.0.0.1:{port}", work))
        for engine in engines:
            wait_for(engine, "/ready", 600)
        port = free_port()
        urls = [e.url for e in engines]
        args_ = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis.url,
                 "--routing", policy, *(f for u in urls for f in ("--engine", u))]
        gateway = spawn(f"{policy}-gateway", args_, f"http://127.0.0.1:{port}", work)
        wait_for(gateway, "/ready")
        time.sleep(6)  # the gateway reads the engines' adapters (every 5 s) before the run
        before = counters(urls)
        spec = LoadSpec(url=gateway.url, num_requests=args.num_requests, rate=args.rate, max_tokens=32,
                        prompt_words=48, ignore_eos=True, seed=args.seed, max_queue_ms=600_000,
                        models=tuple(adapters), model_zipf=args.zipf)
        records = asyncio.run(run_load(spec, progress=False))
        after = counters(urls)
    finally:
        for child in [*engines, *([gateway] if gateway else [])]:
            child.stop()
        redis.stop()
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_1k = {name: 1000 * (after[name] - before[name]) / max(1, len(ok)) for name in COUNTERS}
    result = {"completed": len(ok), "failed": len(records) - len(ok),
              "ttft": latency_stats(ttfts), "e2e_mean_s": sum(r.e2e_s for r in ok) / max(1, len(ok)),
              "adapter_reads_per_1k": per_1k[names.LORA_ADAPTER_READS],
              "slot_loads_per_1k": per_1k[names.LORA_SLOT_LOADS]}
    print(f"{policy:14s} ttft mean {result['ttft']['mean'] * 1000:.0f} ms p90 {result['ttft']['p90'] * 1000:.0f} ms  "
          f"reads/1k {result['adapter_reads_per_1k']:.0f}  slot loads/1k {result['slot_loads_per_1k']:.0f}",
          flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=0.0, help="adapter popularity skew (0: uniform)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    model = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="kvfleet-lora-routing-"))
    adapters = {f"adapter-{i}": write_example_adapter(model, work / "adapters" / str(i), RANK, seed=i)
                for i in range(ADAPTERS)}
    report = {"command": shlex.join(["python", "-m", "bench.lora_routing", *(argv or sys.argv[1:])]),
              "adapters": ADAPTERS, "held_per_engine": HELD, "rank": RANK, "rate": args.rate, "zipf": args.zipf,
              "num_requests": args.num_requests, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "policies": {}}
    for policy in POLICIES:
        report["policies"][policy] = run_policy(policy, args, model, adapters, work)
    ratio = report["policies"]["kvfleet"]["ttft"]["mean"] / report["policies"]["least-request"]["ttft"]["mean"]
    report["mean_ttft_ratio"] = ratio
    print(f"kvfleet / least-request mean TTFT: {ratio:.2f}x (target <= {TARGET})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
