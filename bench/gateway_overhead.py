"""The gateway's own cost: the same short requests sent straight to one engine, through kvfleet's gateways and
through the peer routers (smg, sglang-router, vllm-router; bench/peers.py), all in one run.

    python -m bench.peers install                     # once: each peer in its own venv
    python -m bench.gateway_overhead --rounds 20 --out bench/results
    python -m bench.gateway_overhead --quick          # a ~2-minute smoke run; its figures are noise
    python -m bench.gateway_overhead --arms direct,gateway-envoy,smg
    python -m bench.gateway_overhead --arms direct,gateway-envoy,gateway-envoy-no-migration \
        --peak-max-tokens 64 --peak-stream

One engine of the tiny random Llama (--max-num-seqs 8, one torch thread) and, in front of it, kvfleet gateways
sharing a Redis: `gateway`, the Python proxy (--data-plane python) with default settings; `gateway-no-limit`, the
same never counting the engine as saturated (--saturation-queue 1000000), so that nothing waits in its fleet queue
and what it adds is the proxying alone; `gateway-no-migration`, that with migration off (--migration-limit 0: what
migration costs when nothing fails is gateway-no-limit against it); `gateway-envoy`, Envoy (the default data
plane) with the gateway's endpoint picker deciding, never saturated either, handing the answers it can migrate to the
gateway's app (gateway/envoy/handoff.py); `gateway-envoy-no-migration`, that with migration off (Envoy carries every
answer straight from the engine: what the hand-off costs); and each peer router installed, with
round-robin. Latency: rounds of `--batch` requests per arm at a fixed concurrency, the
arms' order rotated and reversed round by round so drift hits all alike; requests cycle through max_tokens 1-4,
streamed and not, EOS ignored, 16-word prompts. Reports end-to-end p50/p99 per arm, each arm − direct, and how
many requests waited in a kvfleet gateway's queue. Peak: a closed loop of max_tokens-1 requests at
`--peak-concurrency` (32, issue 22's figure) in `--peak-rounds` rounds of one window per arm, rotated like the
latency rounds; an arm's rate is the median of its windows, and its ratio to another arm the median over rounds
of the ratio within a round, so that the machine's drift (other work on the same cores) cancels. With the CPU
each process tree used per request (a gateway's Envoy child counts as the gateway's, and is also shown apart):
what bounds the rate on this 2-core machine, what a router alone could do on one core, and the engine's own CPU
per request behind each arm. Ends with issue 22's targets, each met or missed (bench/overhead_targets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench import peers
from bench.fleet_procs import (
    MODEL_NAME,
    BenchFleet,
    cpu_seconds,
    cpu_used,
    gateway_queue_waits,
    own_cpu_seconds,
    queue_waits_between,
)
from bench.loop_lag import with_loop_lag
from bench.overhead_report import chart, failed_by_arm, format_table, summarize_arms
from bench.overhead_targets import MAX_ADDED_P99_MS, targets
from kvfleet.bench_report import percentile
from kvfleet.loadgen import ENDPOINTS, LoadSpec, PlannedRequest, RequestRecord, make_prompts, send_one

KVFLEET_ARMS = ("direct", "gateway", "gateway-no-limit", "gateway-no-migration", "gateway-envoy",
                "gateway-envoy-no-migration")
ARMS = (*KVFLEET_ARMS, *peers.PEERS)
NO_LIMIT = ["--saturation-queue", "1000000"]  # the engine never counts as saturated: nothing waits in the queue
PYTHON = ["--data-plane", "python"]  # Envoy is the default data plane: the Python proxy's arms name theirs
GATEWAY_FLAGS = {"gateway": PYTHON, "gateway-no-limit": [*NO_LIMIT, *PYTHON],
                 "gateway-no-migration": [*NO_LIMIT, *PYTHON, "--migration-limit", "0"],
                 "gateway-envoy": [*NO_LIMIT, "--data-plane", "envoy"],
                 "gateway-envoy-no-migration": [*NO_LIMIT, "--data-plane", "envoy", "--migration-limit", "0"]}


@dataclasses.dataclass(frozen=True)
class Job:
    index: int
    prompt: str
    max_tokens: int
    stream: bool


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random 3-layer Llama) or a model for the engine")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight in the latency rounds")
    parser.add_argument("--rounds", type=int, default=20, help="latency rounds; each runs both arms")
    parser.add_argument("--batch", type=int, default=100, help="requests per arm per round")
    parser.add_argument("--peak-concurrency", type=int, default=32)
    parser.add_argument("--peak-seconds", type=float, default=5.0, help="length of each peak window")
    parser.add_argument("--peak-rounds", type=int, default=4,
                        help="peak windows per arm, the arms' order rotated round by round")
    parser.add_argument("--peak-max-tokens", type=int, default=1,
                        help="each peak request's max_tokens (1: issue 22's short requests; more, with "
                             "--peak-stream, to see what a router costs per streamed token)")
    parser.add_argument("--peak-stream", action="store_true", help="stream the peak windows' answers")
    parser.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. '--saturation-queue 1000'")
    parser.add_argument("--arms", type=lambda s: [a for a in s.split(",") if a],
                        help=f"comma-separated, from {','.join(ARMS)}; direct is always run; default: all, the peers "
                             "that are installed (python -m bench.peers install)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="few rounds and short peak windows, to check it works")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch, args.peak_seconds, args.peak_rounds = 4, 60, 3.0, 2
    chosen = args.arms or [*KVFLEET_ARMS, *peers.installed_peers()]
    unknown = [a for a in chosen if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    missing = [a for a in chosen if a in peers.PEERS and not peers.PEERS[a].installed()]
    if missing:
        parser.error(f"{', '.join(missing)} not installed: python -m bench.peers install {' '.join(missing)}")
    args.arms = tuple(a for a in ARMS if a == "direct" or a in chosen)
    return args


def make_jobs(n: int, rng: random.Random, max_tokens: Callable[[int], int] = lambda i: 1 + i % 4,
              stream: Callable[[int], bool] = lambda i: (i // 4) % 2 == 0) -> list[Job]:
    """n requests with fresh prompts, cycling through max_tokens 1-4 × streamed or not."""
    return [Job(i, p, max_tokens(i), stream(i)) for i, p in enumerate(make_prompts(n, 16, 0.0, rng))]


async def post_once(client: httpx.AsyncClient, url: str, job: Job, run_start: float) -> RequestRecord:
    """One non-streamed chat completion; the streamed ones go through the load generator's send_one."""
    started = time.perf_counter()
    record = RequestRecord(job.index, "standard", started - run_start)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": job.prompt}], "max_tokens": job.max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    try:
        response = await client.post(url + ENDPOINTS["chat"], json=body)
        record.status, record.engine = response.status_code, response.headers.get("x-kvfleet-engine")
        if response.status_code == 200:
            record.output_tokens = response.json()["usage"]["completion_tokens"]
        else:
            record.error = response.text[:500]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.e2e_s = time.perf_counter() - started
    return record


async def closed_loop(client: httpx.AsyncClient, url: str, jobs: list[Job], concurrency: int,
                      until: float | None = None) -> list[tuple[Job, RequestRecord]]:
    """`concurrency` clients each sending their next job as soon as the last one is answered; all the jobs,
    or until the perf_counter time `until` (jobs are then reused). Each job with what it saw."""
    specs = {n: LoadSpec(url=url, max_tokens=n, ignore_eos=True, model=MODEL_NAME)
             for n in {j.max_tokens for j in jobs}}
    records: list[tuple[Job, RequestRecord]] = []
    run_start, cursor = time.perf_counter(), 0

    async def worker() -> None:
        nonlocal cursor
        while (cursor < len(jobs)) if until is None else (time.perf_counter() < until):
            job = jobs[cursor % len(jobs)]
            cursor += 1
            if job.stream:
                planned = PlannedRequest(job.index, "standard", job.prompt, 0.0)
                record = await send_one(client, specs[job.max_tokens], MODEL_NAME, planned, run_start)
            else:
                record = await post_once(client, url, job, run_start)
            records.append((job, record))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def arm_order(round_no: int, arms: tuple[str, ...] = ARMS) -> tuple[str, ...]:
    """Each arm takes each position equally often: rotate by round, reverse every other round."""
    k = round_no % len(arms)
    order = arms[k:] + arms[:k]
    return order if round_no % 2 == 0 else order[::-1]


def envoy_split(fleet: BenchFleet) -> dict[str, tuple[float, float]]:
    """For each gateway process: (its own CPU s, its children's, i.e. Envoy's), to show Envoy and picker apart."""
    return {g.name: (own_cpu_seconds(g.pid), cpu_seconds(g.pid) - own_cpu_seconds(g.pid)) for g in fleet.gateways}


async def measure(fleet: BenchFleet, urls: dict[str, str], processes: dict[str, str], args: argparse.Namespace) -> dict:
    """Warm-up, the rotated latency rounds, then the peak windows; `processes` names each router arm's process."""
    rng = random.Random(args.seed)
    arms = args.arms
    gateways = [arm for arm in arms if arm in GATEWAY_FLAGS]  # the peers have no kvfleet fleet queue

    async def queue_readings() -> dict[str, dict]:
        return {arm: await asyncio.to_thread(gateway_queue_waits, urls[arm]) for arm in gateways}

    def queued_since(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
        return {arm: queue_waits_between(before[arm], after[arm]) for arm in gateways}

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        for arm in arms:  # warm-up: connections, the gateways' first routes, the engine's first batches
            await closed_loop(client, urls[arm], make_jobs(40, rng), args.concurrency)
        latency: dict[str, list[dict]] = {arm: [] for arm in arms}
        before = await queue_readings()
        for round_no in range(args.rounds):
            for arm in arm_order(round_no, arms):
                records = await closed_loop(client, urls[arm], make_jobs(args.batch, rng), args.concurrency)
                latency[arm] += [{"round": round_no, "stream": job.stream, "max_tokens": job.max_tokens,
                                  "status": r.status, "error": r.error, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s}
                                 for job, r in records]
        waits = queued_since(before, await queue_readings())
        peak: dict[str, list[dict]] = {arm: [] for arm in arms}
        ones = make_jobs(1000, rng, max_tokens=lambda i: args.peak_max_tokens, stream=lambda i: args.peak_stream)
        for peak_round, arm in ((n, arm) for n in range(args.peak_rounds) for arm in arm_order(n, arms)):
            before, cpu_before, started = await queue_readings(), fleet.cpu_snapshot(), time.perf_counter()
            split_before = envoy_split(fleet)
            records = await closed_loop(client, urls[arm], ones, args.peak_concurrency,
                                        until=started + args.peak_seconds)
            wall = time.perf_counter() - started
            cpu, split_after = cpu_used(cpu_before, fleet.cpu_snapshot()), envoy_split(fleet)
            queued = queued_since(before, await queue_readings()).get(arm, {})
            ok = sum(r.ok for _, r in records)
            failed = [r for _, r in records if not r.ok]
            window = {"round": peak_round, "requests": len(records), "ok": ok, "seconds": wall,
                      "requests_per_s": ok / wall,
                      "first_failure": {"status": failed[0].status, "error": failed[0].error} if failed else None,
                      "queued_in_gateway": sum(w["queued"] for w in queued.values()),
                      "cpu_ms_per_request": {k: 1000 * v / max(1, ok) for k, v in cpu.items()}}
            if arm.startswith("gateway-envoy"):
                (own0, envoy0), (own1, envoy1) = split_before[processes[arm]], split_after[processes[arm]]
                window["cpu_split_ms_per_request"] = {"envoy": 1000 * (envoy1 - envoy0) / max(1, ok),
                                                      "picker": 1000 * (own1 - own0) / max(1, ok)}
            peak[arm].append(window)
    return {"latency": latency, "peak": peak, "queue_waits": waits}


def main() -> int:
    args = parse_args()
    if args.replot:
        chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    started = time.monotonic()
    with BenchFleet(args.model, [args.max_num_seqs]) as fleet:
        urls, names = start_arms(fleet, args)
        measured, lag = asyncio.run(with_loop_lag(measure(fleet, urls, names, args)))
    report = build_report(args, names, measured, lag, time.monotonic() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gateway_overhead.json"
    path.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")
    return 0 if report["failures"] == 0 and report["peak_failures"] == 0 else 1


def start_arms(fleet: BenchFleet, args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """Every router arm in front of the one engine: each arm's URL, and the name of the process serving it."""
    urls, names = {"direct": fleet.engines[0].url}, {}
    for arm in args.arms:
        if arm in GATEWAY_FLAGS:
            fleet_name = "overhead" + arm.removeprefix("gateway")
            urls[arm] = fleet.start_gateway("kvfleet", fleet=fleet_name, alongside=True,
                                            extra=[*shlex.split(args.gateway_args), *GATEWAY_FLAGS[arm]])
            names[arm] = f"gateway-{fleet_name}"
        elif arm in peers.PEERS:
            router = peers.start(peers.PEERS[arm], [fleet.engines[0].url], MODEL_NAME, fleet.log_dir)
            fleet.gateways.append(router)  # the fleet stops it and counts its CPU like a gateway's
            urls[arm], names[arm] = router.url, router.name
    return urls, names


def build_report(args: argparse.Namespace, names: dict[str, str], measured: dict, lag: float, wall_s: float) -> dict:
    records = measured["latency"]
    failures = sum(not (r["status"] == 200 and r["error"] is None) for rs in records.values() for r in rs)
    peak = {}
    for arm, windows in measured["peak"].items():
        peak[arm] = {"requests_per_s": percentile([w["requests_per_s"] for w in windows], 50),
                     "requests_per_s_best": max(w["requests_per_s"] for w in windows),
                     "queued_in_gateway": sum(w["queued_in_gateway"] for w in windows),
                     "requests": sum(w["requests"] for w in windows),
                     "failed": sum(w["requests"] - w["ok"] for w in windows),
                     "cpu_ms_per_request": mean_of(windows, "cpu_ms_per_request"), "windows": windows}
        if "cpu_split_ms_per_request" in windows[0]:
            peak[arm]["cpu_split_ms_per_request"] = mean_of(windows, "cpu_split_ms_per_request")
    report = {
        "command": shlex.join(["python", "-m", "bench.gateway_overhead", *sys.argv[1:]]),
        "arms": list(args.arms), "concurrency": args.concurrency, "rounds": args.rounds, "batch": args.batch,
        "peak_concurrency": args.peak_concurrency, "wall_s": wall_s,
        "gateway_args": args.gateway_args, "no_limit_args": " ".join(NO_LIMIT), "gateway_processes": names,
        "peers": {arm: {"requirement": peers.PEERS[arm].requirement, "version": peers.PEERS[arm].version(),
                        "command": shlex.join(peers.PEERS[arm].argv(["ENGINE_URL"], "PORT", "METRICS_PORT"))}
                  for arm in args.arms if arm in peers.PEERS},
        "added_p50_ms": None, "added_p99_ms": None, "target_added_p99_ms": MAX_ADDED_P99_MS,
        "latency": summarize_arms(records), "failures": failures, "failures_by_arm": failed_by_arm(records),
        "peak_failures": sum(p["failed"] for p in peak.values()),
        "gateway_queue_waits": measured["queue_waits"], "peak": peak, "client_loop_lag_s": lag,
        "records": records,
    }
    if "gateway" in records:  # the Python proxy's, as before the peers and Envoy came
        report["added_p50_ms"] = report["latency"]["all"]["added"]["gateway"]["p50_ms"]
        report["added_p99_ms"] = report["latency"]["all"]["added"]["gateway"]["p99_ms"]
    report["targets"] = targets(report)
    return report


def mean_of(windows: list[dict], key: str) -> dict[str, float]:
    return {k: sum(w[key][k] for w in windows) / len(windows) for k in windows[0][key]}


if __name__ == "__main__":
    sys.exit(main())
