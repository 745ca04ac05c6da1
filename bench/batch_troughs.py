"""The Batch API in the fleet's troughs (issue 39's target): a 5,000-request batch beside a Poisson interactive load at
~50 % of the fleet's capacity, against the same work sent by a client loop as `sheddable` requests.

    python -m bench.batch_troughs --json docs/benchmarks/batch_troughs.json

One fleet for the whole run: 2 `kvfleet engine`s of SmolLM2-135M-Instruct (one core each), Redis, and a gateway with
the Batch API (`--batch-dir`). Every request has the same shape: a chat prompt of 48 words, 32 output tokens (EOS
ignored). Phases, one after another:
0. capacity: --burst requests at once; the fleet's saturated output tokens/s and requests/s.
A. interactive alone: Poisson arrivals at --load x the saturated request rate for --window seconds (streamed, TTFT
   per request).
B. the same interactive arrivals (same seed) with a 5,000-request batch created at the start (the openai client's
   files.create and batches.create); the batch's output tokens/s over the window (its completed requests x 32) are
   compared with the capacity the interactive load left idle (saturated tokens/s - interactive tokens/s). Then the
   batch is cancelled and drained.
C. the same interactive arrivals with a client loop: --loop-concurrency workers sending the batch's requests as
   `x-kvfleet-priority: sheddable`, back to back, for the window.
Targets: interactive p99 TTFT in B <= 1.15x A's; batch tokens/s in B >= 0.8x the idle capacity.
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
from openai import OpenAI

from bench.fleet_procs import latency_stats, model_dir, spawn, wait_for
from kvfleet.fleet.engine_settings import EngineSettings
from kvfleet.fleet.ports import free_port
from kvfleet.loadgen import LoadSpec, make_prompts, run_load
from kvfleet.local.redis_server import RedisServer

OUTPUT_TOKENS, PROMPT_WORDS = 32, 48
TTFT_TARGET, THROUGHPUT_TARGET = 1.15, 0.8


def interactive(url: str, rate: float, window_s: float, seed: int) -> dict:
    spec = LoadSpec(url=url, num_requests=max(1, round(rate * window_s)), rate=rate, max_tokens=OUTPUT_TOKENS,
                    prompt_words=PROMPT_WORDS, ignore_eos=True, seed=seed, max_queue_ms=600_000)
    started = time.monotonic()
    records = asyncio.run(run_load(spec, progress=False))
    elapsed = time.monotonic() - started
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(records), "completed": len(ok), "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed,
            "ttft": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None])}


def batch_lines(model: str, n: int, seed: int) -> bytes:
    import random

    prompts = make_prompts(n, PROMPT_WORDS, 0.0, random.Random(seed + 1))
    return b"".join(json.dumps({
        "custom_id": f"job-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": OUTPUT_TOKENS,
                 "ignore_eos": True}}).encode() + b"\n" for i, prompt in enumerate(prompts))


def with_batch(url: str, model: str, args: argparse.Namespace, rate: float) -> dict:
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=2, timeout=120)
    upload = client.files.create(file=("jobs.jsonl", batch_lines(model, args.batch_requests, args.seed)),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    started = time.monotonic()
    load = interactive(url, rate, args.window, args.seed)
    elapsed = time.monotonic() - started
    state = client.batches.retrieve(batch.id)
    done = state.request_counts.completed
    if state.status == "completed":  # it finished within the window: its tokens over its own time
        elapsed = state.completed_at - state.created_at
    else:
        client.batches.cancel(batch.id)
        while client.batches.retrieve(batch.id).status not in ("cancelled", "completed"):
            time.sleep(1)
    return {"interactive": load, "batch_completed": done, "batch_elapsed_s": elapsed,
            "batch_tokens_per_s": done * OUTPUT_TOKENS / elapsed}


def with_loop(url: str, model: str, args: argparse.Namespace, rate: float) -> dict:
    import random

    prompts = make_prompts(args.batch_requests, PROMPT_WORDS, 0.0, random.Random(args.seed + 1))
    stop = time.monotonic() + args.window
    done = [0]

    async def worker(k: int, http: httpx.AsyncClient) -> None:
        i = k
        while time.monotonic() < stop and i < len(prompts):
            body = {"model": model, "messages": [{"role": "user", "content": prompts[i]}],
                    "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
            response = await http.post(f"{url}/v1/chat/completions", json=body,
                                       headers={"x-kvfleet-priority": "sheddable"})
            if response.status_code == 200:
                done[0] += 1
            else:
                await asyncio.sleep(1.0)  # shed: the loop backs off as a polite client would
            i += args.loop_concurrency

    async def loop() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            await asyncio.gather(*(worker(k, http) for k in range(args.loop_concurrency)))

    started = time.monotonic()
    runner = __import__("threading").Thread(target=lambda: asyncio.run(loop()), daemon=True)
    runner.start()
    load = interactive(url, rate, args.window, args.seed)
    runner.join()
    elapsed = time.monotonic() - started
    return {"interactive": load, "loop_completed": done[0], "loop_elapsed_s": elapsed,
            "loop_tokens_per_s": done[0] * OUTPUT_TOKENS / elapsed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=180.0, help="seconds of interactive load per phase")
    p.add_argument("--load", type=float, default=0.5, help="interactive rate as a share of the saturated rate")
    p.add_argument("--burst", type=int, default=160, help="requests at once to measure the saturated rate")
    p.add_argument("--batch-requests", type=int, default=5000)
    p.add_argument("--loop-concurrency", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-share", type=float, default=None, help="the gateway's --batch-share (default: its own)")
    p.add_argument("--no-loop", action="store_true", help="skip phase C (the client loop)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="repeatable: a `kvfleet engine` flag for both engines, e.g. --engine-arg=--background-yield")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    model = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="kvfleet-batch-troughs-"))
    redis = RedisServer().start()
    engines, gateway = [], None
    report = {"command": shlex.join(["python", "-m", "bench.batch_troughs", *(argv or sys.argv[1:])]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "window_s": args.window, "load": args.load,
              "batch_requests": args.batch_requests, "output_tokens": OUTPUT_TOKENS, "prompt_words": PROMPT_WORDS}
    try:
        for i in range(2):
            port = free_port()
            settings = EngineSettings(model=str(model), max_model_len=1024, kv_cache_memory="256MiB",
                                      max_num_seqs=args.max_num_seqs)
            engines.append(spawn(f"engine-{i}", ["engine", *settings.to_args(), "--host", "127.0.0.1", "--port",
                                                 str(port), *args.engine_arg], f"http://127.0.0.1:{port}", work))
        for engine in engines:
            wait_for(engine, "/ready", 600)
        port = free_port()
        gateway = spawn("gateway", ["gateway", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis.url,
                                    "--batch-dir", str(work / "batches"), "--data-plane", "python",
                                    *(["--batch-share", str(args.batch_share)] if args.batch_share else []),
                                    *(f for e in engines for f in ("--engine", e.url))],
                        f"http://127.0.0.1:{port}", work)
        wait_for(gateway, "/ready")
        time.sleep(2)
        served = httpx.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
        # 0: saturated capacity
        spec = LoadSpec(url=gateway.url, num_requests=args.burst, rate=float("inf"), max_tokens=OUTPUT_TOKENS,
                        prompt_words=PROMPT_WORDS, ignore_eos=True, seed=args.seed + 7, max_queue_ms=600_000)
        started = time.monotonic()
        records = asyncio.run(run_load(spec, progress=False))
        elapsed = time.monotonic() - started
        ok = [r for r in records if r.ok]
        saturated = {"requests_per_s": len(ok) / elapsed,
                     "tokens_per_s": sum(r.output_tokens for r in ok) / elapsed}
        report["saturated"] = saturated
        rate = args.load * saturated["requests_per_s"]
        report["interactive_rate"] = rate
        print(f"saturated: {saturated['tokens_per_s']:.0f} tok/s, {saturated['requests_per_s']:.2f} req/s; "
              f"interactive at {rate:.2f} req/s", flush=True)
        report["alone"] = interactive(gateway.url, rate, args.window, args.seed)
        print("alone:", json.dumps(report["alone"]["ttft"]), flush=True)
        report["with_batch"] = with_batch(gateway.url, served, args, rate)
        print("with batch:", json.dumps(report["with_batch"]["interactive"]["ttft"]),
              f"batch {report['with_batch']['batch_tokens_per_s']:.0f} tok/s", flush=True)
        if not args.no_loop:
            report["with_loop"] = with_loop(gateway.url, served, args, rate)
            print("with loop:", json.dumps(report["with_loop"]["interactive"]["ttft"]),
                  f"loop {report['with_loop']['loop_tokens_per_s']:.0f} tok/s", flush=True)
    finally:
        for child in [*engines, *([gateway] if gateway else [])]:
            child.stop()
        redis.stop()
    alone_p99 = report["alone"]["ttft"]["p99"]
    b = report["with_batch"]
    idle = saturated["tokens_per_s"] - b["interactive"]["tokens_per_s"]
    report["ratios"] = {
        "batch_p99_ttft_vs_alone": b["interactive"]["ttft"]["p99"] / alone_p99,
        "batch_tokens_vs_idle_capacity": b["batch_tokens_per_s"] / idle,
    }
    if "with_loop" in report:
        report["ratios"] |= {
            "loop_p99_ttft_vs_alone": report["with_loop"]["interactive"]["ttft"]["p99"] / alone_p99,
            "loop_tokens_vs_idle_capacity": report["with_loop"]["loop_tokens_per_s"] / idle}
    print(json.dumps(report["ratios"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
