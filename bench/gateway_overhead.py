"""The gateway's own cost: the same short requests sent straight to one engine and through the gateway.

    python -m bench.gateway_overhead --rounds 20 --out bench/results
    python -m bench.gateway_overhead --quick          # a ~1-minute smoke run; its figures are noise

One engine of the tiny random Llama (--max-num-seqs 8, one torch thread) and, in front of it, two kvfleet
gateways sharing a Redis: one with default settings and one that never counts the engine as saturated
(--saturation-queue 1000000), so that nothing waits in its fleet queue and what it adds is the proxying alone.
Latency: rounds of `--batch` requests per arm at a fixed concurrency, the arms' order rotated and reversed
round by round so drift hits all alike; requests cycle through max_tokens 1-4, streamed and not, EOS ignored,
16-word prompts. Reports end-to-end p50/p99 per arm, each gateway − direct, and how many requests waited in the
gateway's queue. Peak: a closed loop of max_tokens-1 requests at `--peak-concurrency`, each arm twice, with the
CPU each process used per request: what bounds the rate on this 2-core machine, and what a gateway alone could
do on one core.
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

from bench.fleet_procs import MODEL_NAME, BenchFleet, cpu_used, gateway_queue_waits, queue_waits_between
from bench.loop_lag import describe_lag, with_loop_lag
from bench.plotting import finish, pyplot
from kvfleet.bench_report import percentile
from kvfleet.loadgen import ENDPOINTS, LoadSpec, PlannedRequest, RequestRecord, make_prompts, send_one

TARGET_ADDED_P99_MS = 2.0
ARMS = ("direct", "gateway", "gateway-no-limit", "gateway-envoy")
NO_LIMIT = ["--saturation-queue", "1000000"]  # the engine never counts as saturated: nothing waits in the queue


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
    parser.add_argument("--peak-concurrency", type=int, default=16)
    parser.add_argument("--peak-seconds", type=float, default=8.0, help="length of each peak window")
    parser.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. '--saturation-queue 1000'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="few rounds and short peak windows, to check it works")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch, args.peak_seconds = 4, 60, 3.0
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


def arm_order(round_no: int) -> tuple[str, ...]:
    """Each arm takes each position equally often: rotate by round, reverse every other round."""
    k = round_no % len(ARMS)
    order = ARMS[k:] + ARMS[:k]
    return order if round_no % 2 == 0 else order[::-1]


async def measure(fleet: BenchFleet, urls: dict[str, str], args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    gateways = [arm for arm in ARMS if arm != "direct"]

    async def queue_readings() -> dict[str, dict]:
        return {arm: await asyncio.to_thread(gateway_queue_waits, urls[arm]) for arm in gateways}

    def queued_since(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
        return {arm: queue_waits_between(before[arm], after[arm]) for arm in gateways}

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        for arm in ARMS:  # warm-up: connections, the gateways' first routes, the engine's first batches
            await closed_loop(client, urls[arm], make_jobs(40, rng), args.concurrency)
        latency: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        before = await queue_readings()
        for round_no in range(args.rounds):
            for arm in arm_order(round_no):
                records = await closed_loop(client, urls[arm], make_jobs(args.batch, rng), args.concurrency)
                latency[arm] += [{"round": round_no, "stream": job.stream, "max_tokens": job.max_tokens,
                                  "status": r.status, "error": r.error, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s}
                                 for job, r in records]
        waits = queued_since(before, await queue_readings())
        peak: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        ones = make_jobs(1000, rng, max_tokens=lambda i: 1, stream=lambda i: False)
        for arm in (*ARMS, *ARMS[::-1]):
            before, cpu_before, started = await queue_readings(), fleet.cpu_snapshot(), time.perf_counter()
            records = await closed_loop(client, urls[arm], ones, args.peak_concurrency,
                                        until=started + args.peak_seconds)
            wall = time.perf_counter() - started
            cpu = cpu_used(cpu_before, fleet.cpu_snapshot())
            queued = queued_since(before, await queue_readings()).get(arm, {})
            ok = sum(r.ok for _, r in records)
            peak[arm].append({"requests": len(records), "ok": ok, "seconds": wall, "requests_per_s": ok / wall,
                              "queued_in_gateway": sum(w["queued"] for w in queued.values()),
                              "cpu_ms_per_request": {k: 1000 * v / max(1, ok) for k, v in cpu.items()}})
    return {"latency": latency, "peak": peak, "queue_waits": waits}


def summarize_arms(latency: dict[str, list[dict]]) -> dict:
    """For all requests, streamed and not: p50/p99 end-to-end ms per arm, and each gateway arm − direct."""
    out: dict = {}
    for kind, keep in (("all", lambda r: True), ("stream", lambda r: r["stream"]),
                       ("non-stream", lambda r: not r["stream"])):
        row: dict = {}
        for arm, records in latency.items():
            e2e = [1000 * r["e2e_s"] for r in records if keep(r) and r["status"] == 200 and r["error"] is None]
            row[arm] = {"count": len(e2e), "p50_ms": percentile(e2e, 50), "p99_ms": percentile(e2e, 99)}
        row["added"] = {arm: {q: row[arm][q] - row["direct"][q] for q in ("p50_ms", "p99_ms")}
                        for arm in latency if arm != "direct"}
        out[kind] = row
    out["all"]["added_median_of_rounds"] = {arm: median_round_difference(latency, arm)
                                            for arm in latency if arm != "direct"}
    return out


def median_round_difference(latency: dict[str, list[dict]], arm: str) -> dict[str, float]:
    """The median over rounds of (arm − direct) p50 and p99 within a round: one bad round cannot move it."""
    def e2e_ms(name: str, round_no: int) -> list[float]:
        return [1000 * r["e2e_s"] for r in latency[name]
                if r["round"] == round_no and r["status"] == 200 and r["error"] is None]

    diffs: dict[str, list[float]] = {"p50_ms": [], "p99_ms": []}
    for round_no in sorted({r["round"] for r in latency[arm]}):
        ours, direct = e2e_ms(arm, round_no), e2e_ms("direct", round_no)
        if ours and direct:
            for q in (50, 99):
                diffs[f"p{q}_ms"].append(percentile(ours, q) - percentile(direct, q))
    return {key: percentile(values, 50) for key, values in diffs.items()}


def main() -> int:
    args = parse_args()
    if args.replot:
        chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    started = time.monotonic()
    with BenchFleet(args.model, [args.max_num_seqs]) as fleet:
        urls = {"direct": fleet.engines[0].url,
                "gateway": fleet.start_gateway("kvfleet", fleet="overhead", extra=shlex.split(args.gateway_args)),
                "gateway-no-limit": fleet.start_gateway("kvfleet", fleet="overhead-no-limit", alongside=True,
                                                        extra=[*shlex.split(args.gateway_args), *NO_LIMIT]),
                "gateway-envoy": fleet.start_gateway("kvfleet", fleet="overhead-envoy", alongside=True,
                                                     extra=[*shlex.split(args.gateway_args), *NO_LIMIT,
                                                            "--data-plane", "envoy"])}
        names = {"gateway": "gateway-overhead", "gateway-no-limit": "gateway-overhead-no-limit",
                 "gateway-envoy": "gateway-overhead-envoy"}
        measured, lag = asyncio.run(with_loop_lag(measure(fleet, urls, args)))
    failures = sum(not (r["status"] == 200 and r["error"] is None) for rs in measured["latency"].values() for r in rs)
    peak = {arm: {"requests_per_s": max(w["requests_per_s"] for w in windows),
                  "queued_in_gateway": sum(w["queued_in_gateway"] for w in windows),
                  "requests": sum(w["requests"] for w in windows),
                  "cpu_ms_per_request": {k: sum(w["cpu_ms_per_request"][k] for w in windows) / len(windows)
                                         for k in windows[0]["cpu_ms_per_request"]},
                  "windows": windows} for arm, windows in measured["peak"].items()}
    report = {
        "command": shlex.join(["python", "-m", "bench.gateway_overhead", *sys.argv[1:]]),
        "concurrency": args.concurrency, "rounds": args.rounds, "batch": args.batch,
        "peak_concurrency": args.peak_concurrency, "wall_s": time.monotonic() - started,
        "gateway_args": args.gateway_args, "no_limit_args": " ".join(NO_LIMIT), "gateway_processes": names,
        "added_p50_ms": None, "added_p99_ms": None, "target_added_p99_ms": TARGET_ADDED_P99_MS,
        "latency": summarize_arms(measured["latency"]), "failures": failures,
        "gateway_queue_waits": measured["queue_waits"], "peak": peak, "client_loop_lag_s": lag,
        "records": measured["latency"],
    }
    report["added_p50_ms"] = report["latency"]["all"]["added"]["gateway"]["p50_ms"]
    report["added_p99_ms"] = report["latency"]["all"]["added"]["gateway"]["p99_ms"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gateway_overhead.json"
    path.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")
    return 0 if failures == 0 else 1


def serving_cpu(report: dict, arm: str) -> dict[str, float]:
    """CPU ms per request at the arm's peak: the engine, the gateway serving it (as 'gateway'), client, Redis;
    the idle gateway (it only scrapes) is left out."""
    serving = report["gateway_processes"].get(arm)
    gateways = set(report["gateway_processes"].values())
    per_request = report["peak"][arm]["cpu_ms_per_request"]
    return {("gateway" if name == serving else name): ms for name, ms in per_request.items()
            if name == serving or name not in gateways}


def what_dominates(report: dict) -> list[str]:
    """Two sentences read off the figures: what the gateway's added latency is, and what bounds its peak."""
    lat, waits = report["latency"]["all"], report["gateway_queue_waits"]["gateway"]
    queued = sum(w["queued"] for w in waits.values())
    wait_ms = sum(1000 * (w["mean_wait_s"] or 0) * w["queued"] for w in waits.values()) / max(1, queued)
    added, proxy_only = lat["added"]["gateway"]["p50_ms"], lat["added"]["gateway-no-limit"]["p50_ms"]
    if queued > lat["gateway"]["count"] / 2 and proxy_only < added / 2:
        latency = (f"the added latency is mostly waiting in the gateway's fleet queue ({queued} of "
                   f"{lat['gateway']['count']} requests, {wait_ms:.1f} ms on average): its saturation policy counted "
                   f"the engine as saturated; proxying alone adds p50 {proxy_only:.2f} ms")
    else:
        latency = (f"the added latency is the proxying itself (p50 {added:.2f} ms; with the queue never used "
                   f"{proxy_only:.2f} ms)")
    peak = report["peak"]["gateway"]
    cpu = serving_cpu(report, "gateway")
    top = max(cpu, key=cpu.get)
    bound = (f"the gateway's peak ({peak['requests_per_s']:.0f} req/s) is set by its fleet queue "
             f"({peak['queued_in_gateway']} of {peak['requests']} requests waited), not by CPU"
             if peak["queued_in_gateway"] > peak["requests"] / 2 else
             f"the gateway's peak ({peak['requests_per_s']:.0f} req/s) is bounded by the shared CPU; "
             f"{top} costs the most per request ({cpu[top]:.2f} ms)")
    return [f"what dominates: {latency}.", f"{bound}."]


def format_table(report: dict) -> str:
    lat = report["latency"]
    def cell(p50: float, p99: float) -> str:
        return f"{p50:7.2f} /{p99:7.2f}"

    rows = [f"p50 / p99 ms {'':<4}" + "".join(f"{arm:>18}" for arm in ARMS)
            + "".join(f"{'+' + arm:>20}" for arm in ARMS[1:])]
    for kind in ("all", "stream", "non-stream"):
        row = lat[kind]
        rows.append(f"{kind:<16}" + "".join(f"{cell(row[arm]['p50_ms'], row[arm]['p99_ms']):>18}" for arm in ARMS)
                    + "".join(f"{cell(row['added'][arm]['p50_ms'], row['added'][arm]['p99_ms']):>20}"
                              for arm in ARMS[1:]))
    verdict = "met" if report["added_p99_ms"] <= report["target_added_p99_ms"] else "NOT met"
    waits = []
    for arm in ARMS[1:]:
        w = report["gateway_queue_waits"][arm]
        queued = sum(v["queued"] for v in w.values())
        wait_ms = sum(1000 * (v["mean_wait_s"] or 0) * v["queued"] for v in w.values())
        waits.append(f"{arm}: {queued} of {lat['all'][arm]['count']} requests waited in its fleet queue"
                     + (f" (mean {wait_ms / queued:.1f} ms)" if queued else ""))
    peaks = [f"{arm} {report['peak'][arm]['requests_per_s']:.0f} req/s"
             + (f" ({report['peak'][arm]['queued_in_gateway']} of {report['peak'][arm]['requests']} queued)"
                if arm != "direct" else "") for arm in ARMS]
    cpu_lines = []
    for arm in ARMS:
        cpu = serving_cpu(report, arm)
        line = f"  {arm:<17} " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
        if cpu.get("gateway"):
            line += f"  (the gateway alone on one core: ~{1000 / cpu['gateway']:.0f} req/s)"
        cpu_lines.append(line)
    return "\n".join([
        f"\n{report['command']}",
        f"latency at concurrency {report['concurrency']}, {report['rounds']} rounds of {report['batch']} requests "
        f"per arm, arms rotated (max_tokens 1-4, streamed and not); {report['failures']} failures; "
        f"gateway-no-limit = the gateway with {report['no_limit_args']} (it never counts the engine as saturated)",
        *rows,
        f"added by the gateway: p50 {report['added_p50_ms']:.2f} ms, p99 {report['added_p99_ms']:.2f} ms "
        f"(target p99 <= {report['target_added_p99_ms']} ms: {verdict}; below 0 means within this machine's noise)",
        "median over rounds of the per-round difference: " + "; ".join(
            f"{arm} p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms"
            for arm, d in lat["all"]["added_median_of_rounds"].items()),
        "; ".join(waits),
        f"peak at concurrency {report['peak_concurrency']} (max_tokens 1, not streamed): " + ", ".join(peaks),
        "CPU ms per request at the peak (all processes share this machine's cores):",
        *cpu_lines,
        *what_dominates(report),
        describe_lag(report["client_loop_lag_s"]),
    ])


def chart(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (cdf, cpu) = plt.subplots(1, 2, figsize=(14, 5))
    for arm, color in zip(ARMS, ("tab:gray", "tab:green", "tab:blue", "tab:orange"), strict=True):
        for stream, style in ((True, "-"), (False, "--")):
            values = sorted(1000 * r["e2e_s"] for r in report["records"][arm]
                            if r["stream"] is stream and r["status"] == 200 and r["error"] is None)
            if values:
                cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], style, where="post",
                         color=color, label=f"{arm}, {'streamed' if stream else 'not streamed'}")
    cdf.set(xlabel="end-to-end latency (ms)", ylabel="fraction of requests",
            title=f"max_tokens 1-4 at concurrency {report['concurrency']}: the gateway adds p50 "
                  f"{report['added_p50_ms']:.1f} / p99 {report['added_p99_ms']:.1f} ms")
    parts = {arm: serving_cpu(report, arm) for arm in ARMS}
    names = sorted({k for cpu in parts.values() for k in cpu}, key=lambda k: -max(c.get(k, 0) for c in parts.values()))
    bottom = [0.0] * len(ARMS)
    for name in names:
        values = [parts[arm].get(name, 0.0) for arm in ARMS]
        cpu.bar(ARMS, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, arm in enumerate(ARMS):
        cpu.annotate(f"peak {report['peak'][arm]['requests_per_s']:.0f} req/s", (i, bottom[i]), ha="center",
                     va="bottom", fontsize=9)
    cpu.set(ylabel="CPU ms per request", ylim=(0, max(bottom) * 1.15),
            title=f"CPU per request at the peak (concurrency {report['peak_concurrency']}, max_tokens 1)")
    return finish(fig, path, (cdf, cpu))


if __name__ == "__main__":
    sys.exit(main())
