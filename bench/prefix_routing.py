"""Shared-prefix routing, where KV capacity binds: kvfleet's routing strategies and the peers' cache-aware routers
side by side in one run, in front of the same real SmolLM2 engines.

    python -m bench.prefix_routing --load 0.8 --duration 150         # one load, every arm
    python -m bench.prefix_routing --sweep 0.4,0.6,0.8,1.0            # find the knee
    python -m bench.prefix_routing --quick                            # a ~3-minute smoke; its figures are noise

Workload (bench/prefix_workload.py, seeded): `tenants` (40 tenants with distinct ~400-token system prompts, Zipf
popularity s=1.1, short questions, 16 streamed output tokens) or `chats` (multi-turn conversations resending their
history); Poisson arrivals. `conversations`: closed-loop multi-turn chat (4-8 turns on a few apps' shared system
prompts, --think-s between an answer and the next turn, the model's own answers resent); its figures are over every
turn but each conversation's first:

    python -m bench.prefix_routing --runtime vllm --workload conversations --rounds 2 \
        --arms prefix-affinity,smg,least-request

Each engine's KV cache holds ~4.4k tokens (--kv-cache-memory 194MiB; the engine's own count is printed), far less
than the tenants' prefixes together; one torch thread per engine.
Each arm gets fresh engines: they are restarted (~10 s) so every arm starts from empty prefix caches and zeroed
counters, with nothing to trust about a flush. Its first --warmup requests (default: one per tenant, in shuffled
order) are sent but left out of the figures, so the measured requests hold no tenant's first, unavoidable miss;
the engines' prefix-cache counters are read when the first measured request is sent and after the last finishes.
The capacity behind --load is measured first: each engine fed straight, --calibrate-inflight requests in flight.
kvfleet's gateway runs with its defaults (Envoy data plane where installed) and queues in process unless --redis.
Arms run one after another, so a busy neighbour on this machine skews whichever arm it overlaps.

With --runtime vllm the engines are real vLLM (`vllm serve` from kvfleet's managed install, one core each, bfloat16,
--vllm-kv-blocks blocks of 128 tokens each, prefix caching and KV events on): vLLM takes minutes to start, so the same
engines serve every arm, and each arm begins with their prefix caches emptied (vLLM's dev-mode /reset_prefix_cache)
and its hit rates read from vLLM's own counters as deltas. Every router is fed by the same engines' KV events where
it can take them (kvfleet's precise index; vllm-router's kv_aware).

    python -m bench.prefix_routing --runtime vllm --arms prefix-affinity,smg,vllm-router-kv,least-request
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import peers
from bench.fleet_procs import MODEL_NAME, BenchFleet, cpu_seconds, gateway_queue_waits, queue_waits_between
from bench.prefix_client import closed_loop, run_conversations, run_plan
from bench.prefix_report import chart, format_table, knee_throughput, pooled, ratios, summarize_arm
from bench.prefix_workload import TURNS, WORKLOADS, first_of_key_share, plan, plan_conversations
from kvfleet.fleet.ports import free_port
from kvfleet.local.supervisor import Child, ChildExited, NotReady
from kvfleet.local.supervisor import spawn as spawn_child


@dataclass(frozen=True)
class Arm:
    """A router in front of the engines: 'kvfleet' (the gateway, policy = --routing) or a peer from bench/peers.py
    (policy = --policy), plus extra flags."""

    router: str
    policy: str
    extra: tuple[str, ...] = ()
    engine_extra: tuple[str, ...] = ()  # `kvfleet engine` flags this arm needs (vLLM's ZMQ KV events)
    replicas: int = 1  # kvfleet gateways side by side (one Redis queue), the client dealing requests to each in turn


# The gateway's precise prefix index: it tokenizes as the engines do and follows their KV events.
TOKENIZER = ("--tokenizer", "smollm2-135m-instruct")

# One line per arm; a new gateway strategy is one more line.
ARMS: dict[str, Arm] = {
    "round-robin": Arm("kvfleet", "round-robin"),
    "least-request": Arm("kvfleet", "least-request"),
    "kvfleet": Arm("kvfleet", "kvfleet"),  # the approximate character table (no tokenizer)
    "kvfleet-precise": Arm("kvfleet", "kvfleet", TOKENIZER),
    "estimated-ttft": Arm("kvfleet", "estimated-ttft", TOKENIZER),
    "estimated-ttft-x2": Arm("kvfleet", "estimated-ttft", TOKENIZER, replicas=2),
    "prefix-affinity": Arm("kvfleet", "prefix-affinity", TOKENIZER),
    "prefix-affinity-x2": Arm("kvfleet", "prefix-affinity", TOKENIZER, replicas=2),
    # the engines' load read twice a second whatever a scrape costs them (the gateway's default adapts: scraper.py)
    "prefix-affinity-slow-scrape": Arm("kvfleet", "prefix-affinity", (*TOKENIZER, "--scrape-interval-ms", "500",
                                                                        "--max-metrics-age-ms", "1500")),
    "prefix-affinity-python": Arm("kvfleet", "prefix-affinity", (*TOKENIZER, "--data-plane", "python")),
    # the default routing on the Python proxy, and on Envoy with streams never handed to the app (no migration):
    # where the data path's CPU goes
    "kvfleet-precise-python": Arm("kvfleet", "kvfleet", (*TOKENIZER, "--data-plane", "python")),
    "kvfleet-precise-no-migration": Arm("kvfleet", "kvfleet", (*TOKENIZER, "--migration-limit", "0")),
    "sglang-router": Arm("sglang-router", "cache_aware"),
    "smg": Arm("smg", "cache_aware"),
    "vllm-router": Arm("vllm-router", "cache_aware"),
    "vllm-router-kv": Arm("vllm-router", "kv_aware", engine_extra=("--kv-events-zmq-port", "0")),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=WORKLOADS, default="tenants")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--engines", type=int, default=2, choices=range(1, 5), help="SmolLM2 engines (1-4)")
    p.add_argument("--kv-cache-memory", default="194MiB", help="each engine's KV cache (194MiB: 4,400 tokens)")
    p.add_argument("--runtime", choices=("kvfleet", "vllm"), default="kvfleet", help="the engines: kvfleet's or vLLM")
    p.add_argument("--vllm-kv-blocks", type=int, default=35,
                   help="each vLLM engine's KV cache in 128-token blocks (35: 4,480 tokens, like 194MiB of kvfleet's)")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    p.add_argument("--engine-nice", type=int, default=10,
                   help="the vLLM engines' niceness (0: none): on this 2-core machine they keep both cores busy, and "
                        "a router (any arm's) waits for a core; on a GPU fleet the router has CPUs of its own")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tenants", type=int, default=40, help="tenants (or open conversations for chats)")
    p.add_argument("--zipf", type=float, default=1.1, help="tenant popularity: Zipf exponent")
    p.add_argument("--apps", type=int, default=4, help="conversations: the apps whose system prompts they share")
    p.add_argument("--think-s", type=float, default=3.0,
                   help="conversations: mean think time between an answer and the next turn (exponential)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="arrivals per second (skips the capacity measurement)")
    load.add_argument("--load", type=float, help="arrival rate as a fraction of the measured capacity")
    load.add_argument("--sweep", help="several loads, e.g. 0.4,0.6,0.8,1.0")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of measured arrivals per arm")
    p.add_argument("--warmup", type=int, help="requests sent first and left out of the figures (default: --tenants)")
    p.add_argument("--calibrate-s", type=float, default=30.0, help="seconds of the capacity measurement")
    p.add_argument("--calibrate-inflight", type=int, default=4, help="requests kept in flight per engine then")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a request may take")
    p.add_argument("--redis", action="store_true", help="kvfleet gateways queue in Redis (default: in process)")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="seconds each router runs with no requests first, its idle CPU measured (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the arms this many times, in alternating order, and pool them (a noisy machine)")
    p.add_argument("--quick", action="store_true", help="a ~3-minute smoke of every arm; figures are noise")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--replot", type=Path, help="redraw an earlier run's chart from its JSON and exit")
    args = p.parse_args()
    if args.quick:
        args.tenants, args.duration, args.calibrate_s = 8, 8.0, 10.0
    if args.warmup is None:
        args.warmup = args.tenants
    if args.rate is not None and not args.rate > 0:
        p.error(f"--rate must be a positive number of requests per second, not {args.rate}")
    if args.apps < 1:
        p.error(f"--apps must be at least 1 (the apps whose system prompts conversations share), not {args.apps}")
    if not args.think_s >= 0:
        p.error(f"--think-s must be 0 or more seconds, not {args.think_s}")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if args.rate is None and args.load is None and args.sweep is None:
        args.load = 0.8
    return args


def start_router(arm: Arm, fleet: BenchFleet) -> tuple[str | list[str], Child | None]:
    """The arm's router in front of the fleet's engines: its URL (its replicas' URLs), and its process when it is a
    peer."""
    if arm.router == "kvfleet":
        urls = [fleet.start_gateway(arm.policy, fleet=f"prefix-{arm.policy}", extra=list(arm.extra), alongside=True)
                for _ in range(arm.replicas)]
        return (urls[0] if arm.replicas == 1 else urls), None
    peer = peers.PEERS[arm.router]
    if not peer.installed():
        raise RuntimeError(f"{peer.name} is not installed (python -m bench.peers install {peer.name})")
    port = free_port()
    argv = peer.argv([e.url for e in fleet.engines], port, free_port())
    argv[argv.index("--policy") + 1] = arm.policy  # peers.py starts them round-robin, for its overhead run
    child = spawn_child(f"{arm.router}-{arm.policy}", [*argv, *arm.extra], url=f"http://127.0.0.1:{port}",
                        log_dir=fleet.log_dir)
    try:
        child.wait_ready(lambda: peers.answers_chat(child.url, MODEL_NAME), 90.0, poll_s=0.5)
    except BaseException:
        child.stop()
        raise
    return child.url, child


def cpu_by_role(fleet: BenchFleet, peer: Child | None) -> dict[str, float]:
    """CPU seconds used so far by the router (kvfleet's gateways with their Envoy, or the peer) and the engines."""
    routers = fleet.gateways if peer is None else [peer]
    return {"router": sum(cpu_seconds(r.pid) for r in routers),
            "engines": sum(cpu_seconds(e.pid) for e in fleet.engines)}


def idle_router_cpu(fleet: BenchFleet, peer: Child | None, seconds: float) -> float | None:
    """The router's CPU milliseconds per second over `seconds` with no request in flight (None: not measured)."""
    if seconds <= 0:
        return None
    before, started = cpu_by_role(fleet, peer)["router"], time.monotonic()
    time.sleep(seconds)
    return 1000 * (cpu_by_role(fleet, peer)["router"] - before) / (time.monotonic() - started)


def queue_waits(url: str | list[str]) -> dict[str, dict]:
    """The kvfleet gateways' fleet-queue counts per class, summed over replicas ({} for a peer)."""
    out: dict[str, dict] = {}
    for one in [url] if isinstance(url, str) else url:
        for priority, w in gateway_queue_waits(one).items():
            total = out.setdefault(priority, {"queued": 0, "wait_s": 0.0})
            total["queued"] += w["queued"]
            total["wait_s"] += w["wait_s"]
    return out


def engine_capacity_line(engine: Child) -> str:
    found = re.findall(r"KV cache(?: size)?: [^\n]*", engine.output())  # kvfleet's; vLLM's
    return found[-1] if found else "KV cache: (not in the log)"


def new_fleet(args: argparse.Namespace, arm: Arm | None = None) -> BenchFleet:
    replicas = arm.replicas if arm is not None else 1
    if args.runtime == "vllm":  # one fleet for every arm (vLLM publishes its KV events without being asked)
        return BenchFleet("smollm2-135m-instruct", [args.max_num_seqs] * args.engines,
                          max_model_len=args.max_model_len, use_redis=args.redis, runtime="vllm",
                          engine_nice=args.engine_nice,
                          engine_args=["--dtype", args.vllm_dtype, "--num-gpu-blocks-override",
                                       str(args.vllm_kv_blocks)])
    return BenchFleet("smollm2-135m-instruct", [args.max_num_seqs] * args.engines, max_model_len=args.max_model_len,
                      kv_cache_memory=args.kv_cache_memory, use_redis=args.redis or replicas > 1,
                      engine_args=list(arm.engine_extra) if arm else [])


def arm_fleet(args: argparse.Namespace, arm: Arm, shared: BenchFleet | None):
    """The engines an arm runs on: fresh ones, or the shared (vLLM) ones with their prefix caches emptied."""
    if shared is None:
        return new_fleet(args, arm)
    shared.wait_idle()
    shared.reset_prefix_caches()
    return nullcontext(shared)


def run_arm(name: str, args: argparse.Namespace, rate: float, shared: BenchFleet | None = None) -> dict:
    """The arm's router in front of its engines, the workload through it; its figures, or why it did not run."""
    conversations = args.workload == "conversations"
    requests = [] if conversations else plan(args.workload, args.warmup + max(1, round(rate * args.duration)), rate,
                                             args.seed, args.tenants, args.zipf)
    with arm_fleet(args, ARMS[name], shared) as fleet:
        names = {e.url: f"engine-{i}" for i, e in enumerate(fleet.engines)}
        try:
            url, child = start_router(ARMS[name], fleet)
        except (RuntimeError, ChildExited, NotReady, OSError) as exc:
            print(f"{name}: did not start: {str(exc)[:300]}", flush=True)
            return {"arm": asdict(ARMS[name]), "error": str(exc)[-2000:]}
        try:
            idle_cpu_ms_per_s = idle_router_cpu(fleet, child, args.idle_s)
            started = time.monotonic()
            cpu_before, waits_before = cpu_by_role(fleet, child), queue_waits(url)
            if conversations:  # closed-loop: the turns as sent come back with their records
                records, deltas, requests = asyncio.run(run_conversations(
                    url, MODEL_NAME, conversation_plan(args, rate), list(names), args.max_tokens, args.timeout))
            else:
                records, deltas = asyncio.run(run_plan(url, MODEL_NAME, requests, list(names), args.warmup,
                                                       args.max_tokens, args.timeout))
            cpu = {role: s - cpu_before[role] for role, s in cpu_by_role(fleet, child).items()}
            busy_s = time.monotonic() - started
            waits = queue_waits_between(waits_before, queue_waits(url))
        finally:
            if child is not None:
                child.stop()
            fleet.stop_gateway()
        # conversations: every turn but each conversation's first (the figure multi-turn serving is judged by)
        summary = summarize_arm(records, deltas, requests, 0 if conversations else args.warmup, names,
                                skip_firsts=conversations)
        # Where the time goes: the router's own CPU (on a 2-core machine it is taken from the engines) and the
        # requests it held in a queue of its own (warm-up included in both).
        summary["cpu_s"] = {role: round(s, 2) for role, s in cpu.items()}
        summary["router_cpu_ms_per_request"] = round(1000 * cpu["router"] / max(1, len(requests)), 2)
        # what the router spends with no request at all (scrapes, KV events, timers), and what each request adds
        idle_note = ""
        summary["router_idle_cpu_ms_per_s"] = summary["router_request_cpu_ms"] = None
        if idle_cpu_ms_per_s is not None:
            summary["router_idle_cpu_ms_per_s"] = round(idle_cpu_ms_per_s, 2)
            summary["router_request_cpu_ms"] = round(
                (1000 * cpu["router"] - idle_cpu_ms_per_s * busy_s) / max(1, len(requests)), 2)
            idle_note = (f" ({idle_cpu_ms_per_s:.1f} ms/s idle, {summary['router_request_cpu_ms']:.1f} ms/request "
                         "beyond)")
        summary["router_queue"] = waits
        ttft = {k: f"{v:.3f}" if v is not None else "-" for k, v in summary["ttft_s"].items()}
        print(f"{name}: {summary['ok']}/{summary['count']} ok, TTFT mean {ttft['mean']} p90 {ttft['p90']} s, "
              f"{summary['completed_per_s'] or 0:.2f} req/s, hit rate {summary['fleet_hit_rate'] or 0:.1%}, "
              f"engines' own TTFT mean {summary['engine_ttft_mean_s'] or 0:.3f} s, "
              f"router CPU {summary['router_cpu_ms_per_request']:.1f} ms/request{idle_note}, "
              f"engines' CPU {cpu['engines']:.0f} s, "
              f"queued in the router {sum(w['queued'] for w in waits.values())}, in {time.monotonic() - started:.0f} s",
              flush=True)
        return {"arm": asdict(ARMS[name]), "summary": summary, "records": [asdict(r) for r in records]}


def conversation_plan(args: argparse.Namespace, rate: float) -> list:
    """The conversations of an arm: turns arriving at about `rate` per second for --duration seconds."""
    return plan_conversations(max(1, round(rate * args.duration)), rate, args.seed, args.apps, args.think_s,
                              zipf_s=args.zipf)


def measure_capacity(args: argparse.Namespace, shared: BenchFleet | None = None) -> dict:
    """Completed req/s with every engine kept full, the workload sent straight to them (no router, no affinity);
    conversations are measured on `chats`, the open-loop multi-turn plan of the same shape."""
    workload = "chats" if args.workload == "conversations" else args.workload
    requests = plan(workload, 5_000, 1.0, args.seed + 1, args.tenants, args.zipf)
    with new_fleet(args) if shared is None else nullcontext(shared) as fleet:
        print(engine_capacity_line(fleet.engines[0]), flush=True)
        # The first answers wait for a whole round of prefills: 10 s before counting.
        out = asyncio.run(closed_loop([e.url for e in fleet.engines], MODEL_NAME, requests, args.calibrate_inflight,
                                      args.calibrate_s, 10.0, args.max_tokens))
        out["kv_cache"] = engine_capacity_line(fleet.engines[0])
    if out["requests_per_s"] <= 0:
        raise SystemExit(f"no request completed in the {args.calibrate_s:g} s of the capacity measurement; "
                         "give it longer (--calibrate-s) or name the rate (--rate)")
    return out


def main() -> None:
    args = parse_args()
    if args.replot:
        print(chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png")))
        return
    with new_fleet(args) if args.runtime == "vllm" else nullcontext(None) as shared:
        run(args, shared)


def run(args: argparse.Namespace, shared: BenchFleet | None) -> None:
    started = time.monotonic()
    capacity = None if args.rate is not None else measure_capacity(args, shared)
    if capacity is not None:
        print(f"capacity: {capacity['requests_per_s']:.2f} req/s with every engine full", flush=True)
        loads = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.load]
        rates = {f"{x:g}": x * capacity["requests_per_s"] for x in loads}
    else:
        rates = {f"{args.rate:g} req/s": args.rate}
    runs: dict[str, dict] = {}
    tag = ("quick" if args.quick else "sweep" if args.sweep else
           f"load{args.load:g}" if args.load is not None else f"rate{args.rate:g}")
    path = args.out / f"prefix_routing_{args.workload}_{tag}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    for key, rate in rates.items():
        if args.workload == "conversations":
            talks = conversation_plan(args, rate)
            print(f"load {key}: {rate:.2f} turns/s offered, {len(talks)} conversations of "
                  f"{sum(len(c.questions) for c in talks)} turns per arm, {args.think_s:g} s mean think time; "
                  "figures over every turn but the first", flush=True)
        else:
            sample = plan(args.workload, args.warmup + max(1, round(rate * args.duration)), rate, args.seed,
                          args.tenants, args.zipf)
            print(f"load {key}: {rate:.2f} req/s, {len(sample)} requests per arm ({args.warmup} warm-up), "
                  f"{first_of_key_share(sample[args.warmup:]):.1%} of the measured ones a tenant's first", flush=True)
        for r in range(args.rounds):
            order = args.arms if r % 2 == 0 else args.arms[::-1]
            done = {name: run_arm(name, args, rate, shared) for name in order}
            runs[key if args.rounds == 1 else f"{key} round {r + 1}"] = {name: done[name] for name in args.arms}
            report = build_report(args, capacity, rates, runs, time.monotonic() - started)
        path.write_text(json.dumps(report, indent=2))  # after each load, so a long sweep cut short keeps some
    print(format_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")


def build_report(args: argparse.Namespace, capacity: dict | None, rates: dict[str, float], runs: dict[str, dict],
                 wall_s: float) -> dict:
    who = (f"{args.apps} apps' system prompts, {TURNS[0]}-{TURNS[1]} turns, {args.think_s:g} s mean think time"
           if args.workload == "conversations" else f"{args.tenants} tenants")
    setup = (f"{args.workload}: {who}, Zipf {args.zipf}, {args.max_tokens} output tokens; "
             f"{args.engines} SmolLM2 engines, KV {args.kv_cache_memory} each, max-num-seqs {args.max_num_seqs}"
             if args.runtime == "kvfleet" else
             f"{args.workload}: {who}, Zipf {args.zipf}, {args.max_tokens} output tokens; "
             f"{args.engines} vLLM {args.vllm_dtype} engines (one core each), {args.vllm_kv_blocks} KV blocks of 128 "
             f"tokens each, max-num-seqs {args.max_num_seqs}")
    return {
        "command": shlex.join(["python", "-m", "bench.prefix_routing", *sys.argv[1:]]), "setup": setup,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "capacity": capacity, "rates": rates, "wall_s": wall_s,
        "ratios": {key: ratios(arms) for key, arms in runs.items()},
        "knee_requests_per_s": knee_throughput(runs), "runs": runs,
        "pooled": {} if args.rounds == 1 else {key: pooled([arms for k, arms in runs.items()
                                                              if k.startswith(f"{key} round ")]) for key in rates
                                          if f"{key} round 1" in runs},
    }

if __name__ == "__main__":
    main()
