"""Noisy neighbour (issue 16): one tenant floods at 5x the fleet's capacity, two light tenants send 0.1x each, all
in one class, through 2 gateway replicas sharing Redis, one of them killed mid-run; today's policy and the fair one.

    python -m bench.noisy_neighbour --duration 90                 # every arm, then the order phase
    python -m bench.noisy_neighbour --order-only                  # the order phase alone (Redis, no engine)
    python -m bench.noisy_neighbour --gateway-arg=--tenant-max-queued=50 --json out.json

Setup: one real SmolLM2 engine (--model) behind `kvfleet gateway` replicas on the default data plane (Envoy and the
picker; `--data-plane python` for the Python proxy, which earlier runs used) sharing one Redis. Capacity (req/s) is
measured first, closed loop, straight to the engine. Tenants (x-kvfleet-tenant, no API keys) send seeded open-loop
Poisson arrivals, every request `standard`, non-streamed, --max-tokens with EOS ignored; the same plan in every arm. The
client deals requests round-robin over the replicas, as a Service would. At --kill-at of the run one replica gets
SIGKILL: a request that cannot connect, or loses its connection, is retried once on the other replica (counted); one
that still gets no HTTP answer, or none within the queue deadline + 120 s, is "lost".

Arms (alternating order with --rounds > 1): fcfs (today's policy), fair, fair-1-replica (one replica, no kill: the
single-queue reference) and alone (B and C only, fair, 2 replicas, no kill: the p99 reference). The peer arms put smg
(its PyPI release, bench/peers.py) in front of the same engines with its priority scheduler, the tenant from the same
header (--trust-tenant-header), one replica, no kill, the same queue deadline for every class, as many slots as the
engines have sequences: smg-priority gives every tenant smg's `default` class (nothing known in advance, as kvfleet's
arms); smg-priority-tagged caps tenant A at `bulk` in smg's tenant policy, as an operator who named the flood ahead of
time would.

With --runtime vllm the engines are real vLLM (`vllm serve` from kvfleet's managed install, bfloat16, one core each,
niced so routers get a core, --scheduling-policy priority as kvfleet runs vLLM):

    python -m bench.noisy_neighbour --runtime vllm --engines 2 \
        --arms alone,fair,fair-1-replica,fcfs,smg-priority,smg-priority-tagged

Fairness. A tenant is *backlogged* when its demand (requests sent x mean tokens of an answered request) exceeds its
max-min fair share of what the arm served in total (water-filling: light tenants get all they ask, the rest is split
evenly). Jain's index over the backlogged tenants' served tokens is the issue's target; B and C (0.1x each) are
rarely backlogged, leaving A alone (index 1 by definition), so Jain's index over served / fair share for every tenant
is reported too: 1.0 when each got its fair share, low when the flood took the light tenants' share.

Order phase (bench/fair_order_check.py): the fair order through two replicas sharing Redis against one queue's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench import peers
from bench.capacity import saturated_throughput
from bench.fair_order_check import order_phase
from bench.fleet_procs import MODEL_NAME, BenchFleet, get, spawn, wait_for
from kvfleet.bench_report import percentile
from kvfleet.fleet import headers
from kvfleet.fleet.ports import free_port
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.config import DATA_PLANES, GatewayConfig
from kvfleet.loadgen import LoadSpec, arrival_times, make_prompts
from kvfleet.local.supervisor import Child, stop_together
from kvfleet.local.supervisor import spawn as spawn_child

# httpcore's pool scans all its connections for every request: with a thousand in flight (a flood a router holds for
# seconds) one client spent its loop there and sent the plan up to 10 s late; the requests are dealt over this many
CLIENT_POOLS = 32
LOST_AFTER_QUEUE_S = 120.0  # a request's timeout: the queue deadline plus this, so a hang shows as "lost"


# ---- pure figures --------------------------------------------------------------------------------------------------
def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one has everything."""
    if not values:
        return None
    squares = sum(x * x for x in values)
    return 1.0 if squares == 0 else sum(values) ** 2 / (len(values) * squares)


def max_min_fair_shares(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: tenants asking less than an even split get their demand; the rest share what is left evenly."""
    shares, left, open_ = {}, capacity, sorted(demands, key=lambda t: demands[t])
    while open_:
        even = left / len(open_)
        if demands[open_[0]] > even:
            return shares | {t: even for t in open_}
        tenant = open_.pop(0)
        shares[tenant] = demands[tenant]
        left -= demands[tenant]
    return shares


def backlogged(demands: dict[str, float], shares: dict[str, float], slack: float = 1.01) -> list[str]:
    """Tenants that asked for more than their fair share (by more than `slack`): the ones kept waiting."""
    return sorted(t for t in demands if demands[t] > shares.get(t, 0.0) * slack)


def latency_quantiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


# ---- the workload and its client ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    index: int
    tenant: str
    send_at: float
    prompt: str


@dataclass
class Record:
    """What one request saw; `retried` says why its first replica failed ("connect" or "connection lost")."""

    index: int
    tenant: str
    sent_at: float
    replica: int
    status: int | None = None  # None: no HTTP answer at all (lost)
    latency_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retried: str | None = None
    error: str | None = None


def plan_tenants(rates: dict[str, float], duration_s: float, prompt_words: int, seed: int) -> list[Planned]:
    """Each tenant's own seeded Poisson stream over `duration_s`, merged by send time."""
    out: list[tuple[float, str, str]] = []
    for k, (tenant, rate) in enumerate(sorted(rates.items())):
        rng = random.Random(seed * 1000 + k)
        times = [t for t in arrival_times(round(rate * duration_s * 2) + 20, rate, rng) if t < duration_s]
        out += zip(times, [tenant] * len(times), make_prompts(len(times), prompt_words, 0.0, rng), strict=True)
    return [Planned(i, tenant, t, prompt) for i, (t, tenant, prompt) in enumerate(sorted(out))]


def retry_reason(exc: Exception) -> str | None:
    """Why a first attempt may go to the other replica: it could not connect, or lost its connection."""
    if isinstance(exc, httpx.TimeoutException):
        return None
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TransportError):
        return "connection lost"
    return None


async def post(client: httpx.AsyncClient, url: str, req: Planned, max_tokens: int, record: Record) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": req.prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    response = await client.post(url + "/v1/chat/completions", json=body,
                                 headers={headers.TENANT: req.tenant, headers.PRIORITY: Priority.STANDARD.value})
    record.status = response.status_code
    if response.status_code != 200:
        record.error = response.text[:300]
        return
    usage = response.json().get("usage") or {}
    record.prompt_tokens, record.completion_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


async def send(client: httpx.AsyncClient, urls: list[str], req: Planned, max_tokens: int, timeout_s: float,
               run_start: float) -> Record:
    """One request to its round-robin replica, retried once on the next one if it could not connect or lost its
    connection; always a record."""
    started = time.perf_counter()
    first = req.index % len(urls)
    record = Record(req.index, req.tenant, started - run_start, first)
    try:
        async with asyncio.timeout(timeout_s):
            try:
                await post(client, urls[first], req, max_tokens, record)
            except httpx.HTTPError as exc:
                record.retried = retry_reason(exc)
                if record.retried is None:
                    raise
                record.replica = (first + 1) % len(urls)
                await post(client, urls[record.replica], req, max_tokens, record)
    except TimeoutError:
        record.error = f"no answer within {timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.latency_s = time.perf_counter() - started
    return record


async def run_plan(urls: list[str], plan: list[Planned], max_tokens: int, timeout_s: float,
                   kill: tuple[float, Child] | None) -> tuple[list[Record], float | None]:
    """The plan open loop over the replicas; SIGKILL to `kill`'s replica at its offset. Records, kill offset."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    killed_at: float | None = None
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits))
                   for _ in range(CLIENT_POOLS)]
        run_start = time.perf_counter()

        async def killer() -> None:
            nonlocal killed_at
            await asyncio.sleep(kill[0])
            kill[1].kill()
            killed_at = time.perf_counter() - run_start

        killing = asyncio.create_task(killer()) if kill else None
        tasks = []
        for req in plan:
            delay = run_start + req.send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(clients[req.index % CLIENT_POOLS], urls, req, max_tokens, timeout_s,
                                                  run_start)))
        records = await asyncio.gather(*tasks)
        if killing:
            await killing
    return sorted(records, key=lambda r: r.index), killed_at


# ---- arms -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arm:
    policy: str  # kvfleet's --queue-policy; for smg, its routing policy
    replicas: int
    kill: bool
    tenants: tuple[str, ...] = ("A", "B", "C")
    flags: tuple[str, ...] = ()  # the arm's own gateway flags
    router: str = "kvfleet"  # or "smg"
    smg_max_class: tuple[tuple[str, str], ...] = ()  # smg's tenant policy: (tenant, max_class)


# fair-fifo-engines: the fair queue without the engine priority it gives tenants under their share (all requests
# here are standard, so --no-forward-priority turns off only that): what the engines' own FIFO queues undo
ARMS = {"fcfs": Arm("fcfs", 2, True), "fair": Arm("fair", 2, True),
        "fair-fifo-engines": Arm("fair", 2, True, flags=("--no-forward-priority",)),
        "fair-1-replica": Arm("fair", 1, False), "alone": Arm("fair", 2, False, ("B", "C")),
        "smg-priority": Arm("cache_aware", 1, False, router="smg"),
        "smg-priority-tagged": Arm("cache_aware", 1, False, router="smg", smg_max_class=(("A", "bulk"),))}
LIGHT = ("B", "C")


def start_replicas(fleet: BenchFleet, arm: Arm, name: str, extra: list[str]) -> list[Child]:
    """The arm's gateway replicas, one Redis fleet of their own, each ready once it has scraped the engine."""
    gateways = []
    for i in range(arm.replicas):
        port = free_port()
        args = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--fleet", name,
                "--queue-policy", arm.policy, "--redis-url", fleet.redis.url,
                *(f for e in fleet.engines for f in ("--engine", e.url)), *arm.flags, *extra]
        gateways.append(spawn(f"gateway-{name}-{i}", args, f"http://127.0.0.1:{port}", fleet.log_dir))
    try:
        for g in gateways:
            wait_for(g, "/ready", check=lambda body: json.loads(body)["available"] == len(fleet.engines))
    except BaseException:
        stop_together(gateways)
        raise
    return gateways


# smg 1.13's built-in class settings (model_gateway/src/middleware/scheduler/config.rs); its YAML takes a class whole
SMG_CLASS_DEFAULTS = {
    "system": {"reserved_floor": 32, "reserved_per_slot": 0.0, "queue_size": 64, "queue_timeout_secs": 30,
               "starvation_threshold_secs": 5, "can_preempt": True},
    "interactive": {"reserved_floor": 128, "reserved_per_slot": 0.25, "queue_size": 256, "queue_timeout_secs": 30,
                    "starvation_threshold_secs": 5, "can_preempt": True},
    "default": {"reserved_floor": 0, "reserved_per_slot": 0.10, "queue_size": 512, "queue_timeout_secs": 60,
                "starvation_threshold_secs": 30, "can_preempt": False},
    "bulk": {"reserved_floor": 0, "reserved_per_slot": 0.0, "queue_size": 1024, "queue_timeout_secs": 300,
             "starvation_threshold_secs": 120, "can_preempt": False}}


def smg_scheduler_config(arm: Arm, queue_s: int) -> dict:
    """smg's priority-scheduler YAML (JSON is YAML): smg's own class settings, except that every class waits
    `queue_s` at most, as kvfleet's queue deadline, and `system` and `interactive`, which no request here uses,
    reserve nothing (smg's defaults hold 160 slots and a quarter of the rest back for them: more than these engines
    have, and smg would fall back to its plain concurrency limit); `default` keeps its reservation (a tenth of the
    slots, held back from `bulk`). The arm's tenant caps, keyed as smg keys a header tenant."""
    unused = {"reserved_floor": 0, "reserved_per_slot": 0.0}
    return {"classes": {c: {**d, **(unused if c in ("system", "interactive") else {}), "queue_timeout_secs": queue_s}
                        for c, d in SMG_CLASS_DEFAULTS.items()},
            "tenant_policies": {f"header:{tenant}": {"max_class": cls} for tenant, cls in arm.smg_max_class}}


def start_smg(fleet: BenchFleet, arm: Arm, name: str, args: argparse.Namespace) -> tuple[Child, str]:
    """smg in front of the engines with its priority scheduler, the tenant from the header the client sends. smg
    sizes the scheduler from each worker's `max_running_requests`, which it reads from SGLang's /server_info and
    otherwise takes as 64 (vLLM reports none): the engines are registered through its /workers API with their
    --max-num-seqs as that label, so that smg holds the excess in its class queues as kvfleet's gateway does, rather
    than in the engines' own first-come queues."""
    peer = peers.PEERS["smg"]
    if not peer.installed():
        raise RuntimeError("smg is not installed (python -m bench.peers install smg)")
    config = fleet.log_dir / f"smg-{name}.yaml"
    config.write_text(json.dumps(smg_scheduler_config(arm, max(1, round(args.max_queue_ms / 1000)))))
    port, metrics_port = free_port(), free_port()
    argv = [*peer.argv([], port, metrics_port, policy=arm.policy), "--priority-scheduler-enabled",
            "--priority-scheduler-config", str(config), "--trust-tenant-header", "--tenant-header-name",
            headers.TENANT]
    child = spawn_child(f"smg-{name}", argv, url=f"http://127.0.0.1:{port}", log_dir=fleet.log_dir)
    try:
        child.wait_ready(lambda: get(child.url + "/health") is not None, 30.0, poll_s=0.2)
        for engine, seqs in zip(fleet.engines, fleet.max_num_seqs, strict=True):
            response = httpx.post(child.url + "/workers", timeout=30, json={
                "url": engine.url, "labels": {"max_running_requests": str(seqs)}})
            if response.status_code >= 300:
                raise RuntimeError(f"smg refused {engine.url}: {response.status_code} {response.text[:300]}")
        child.wait_ready(lambda: peers.answers_chat(child.url, MODEL_NAME), 90.0, poll_s=0.5)
    except BaseException:
        child.stop()
        raise
    return child, f"http://127.0.0.1:{metrics_port}/metrics"


def smg_scheduler_counts(metrics_url: str) -> dict[str, float]:
    """What smg's scheduler did: admissions per class and outcome, and how many waited in its class queues."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(get(metrics_url) or ""):
        for sample in family.samples:
            if sample.name == "smg_scheduler_admit_total":
                out[f"{sample.labels['class']} {sample.labels['outcome']}"] = sample.value
            elif sample.name == "smg_scheduler_queue_wait_seconds_count":
                out[f"{sample.labels['class']} queued"] = sample.value
    return out


def run_arm(fleet: BenchFleet, name: str, tag: str, plan: list[Planned], args: argparse.Namespace) -> dict:
    arm = ARMS[name]
    smg_metrics = None
    if arm.router == "smg":
        smg, smg_metrics = start_smg(fleet, arm, f"{name}-{tag}", args)
        gateways = [smg]
    else:
        gateways = start_replicas(fleet, arm, f"nn-{name}-{tag}", ["--data-plane", args.data_plane, *args.gateway_arg,
                                                                   "--max-queue-ms", str(args.max_queue_ms)])
    mine = [r for r in plan if r.tenant in arm.tenants]
    kill = (args.kill_at * args.duration, gateways[-1]) if arm.kill else None
    try:
        records, killed_at = asyncio.run(run_plan([g.url for g in gateways], mine, args.max_tokens,
                                                  args.max_queue_ms / 1000 + LOST_AFTER_QUEUE_S, kill))
        scheduler = smg_scheduler_counts(smg_metrics) if smg_metrics else None
    finally:
        stop_together(gateways)
    fleet.wait_idle(timeout_s=args.max_queue_ms / 1000 + LOST_AFTER_QUEUE_S)
    summary = summarize_arm(records, arm.tenants)
    # how late the client sent against the plan: a load generator that cannot keep up measures itself
    planned = {r.index: r.send_at for r in mine}
    summary["client_late_s"] = max((r.sent_at - planned[r.index] for r in records), default=0.0)
    print(f"{name} ({tag}): " + ", ".join(f"{t} {s['status']['200']}/{s['sent']} ok p99 {_s(s['latency_s']['p99'])}"
                                          for t, s in summary["tenants"].items())
          + f"; the client sent at most {summary['client_late_s']:.2f} s late", flush=True)
    if scheduler is not None:
        print(f"{name} ({tag}): smg's scheduler: {scheduler}", flush=True)
    return {"arm": asdict(arm), "killed_at_s": killed_at, "summary": summary, "smg_scheduler": scheduler,
            "records": [asdict(r) for r in records]}


# ---- figures per arm ----------------------------------------------------------------------------------------------
def summarize_arm(records: list[Record], tenants: tuple[str, ...]) -> dict:
    """Per tenant: statuses, latency of 200s, served tokens; for the arm: fair shares, Jain's indices, the kill."""
    per: dict[str, dict] = {}
    for tenant in tenants:
        mine = [r for r in records if r.tenant == tenant]
        ok = [r for r in mine if r.status == 200]
        status = {"200": len(ok), "429": sum(r.status == 429 for r in mine), "503": sum(r.status == 503 for r in mine),
                  "lost": sum(r.status is None for r in mine)}
        status["other"] = len(mine) - sum(status.values())
        per[tenant] = {"sent": len(mine), "status": status, "latency_s": latency_quantiles([r.latency_s for r in ok]),
                       "served_tokens": sum(r.prompt_tokens + r.completion_tokens for r in ok),
                       "completion_tokens": sum(r.completion_tokens for r in ok)}
    answered = [r for r in records if r.status == 200]
    per_request = sum(per[t]["served_tokens"] for t in tenants) / len(answered) if answered else 0.0
    demands = {t: per[t]["sent"] * per_request for t in tenants}
    served = {t: float(per[t]["served_tokens"]) for t in tenants}
    shares = max_min_fair_shares(demands, sum(served.values()))
    heavy = backlogged(demands, shares)
    for t in tenants:
        per[t] |= {"demand_tokens": demands[t], "fair_share_tokens": shares[t],
                   "served_over_share": served[t] / shares[t] if shares[t] else None}
    retried = [r for r in records if r.retried]
    return {"tenants": per, "backlogged": heavy, "jain_backlogged": jain_index([served[t] for t in heavy]),
            "jain_share": jain_index([per[t]["served_over_share"] or 0.0 for t in tenants]),
            "retried": {"connect": sum(r.retried == "connect" for r in retried),
                        "connection lost": sum(r.retried == "connection lost" for r in retried),
                        "answered": sum(r.status is not None for r in retried)},
            "answered": sum(r.status is not None for r in records), "lost": sum(r.status is None for r in records)}


def light_p99_ratios(arms: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Per arm, B's and C's p99 latency over their p99 in the `alone` arm (the issue's target: <= 1.5)."""
    alone = arms.get("alone", {}).get("summary", {}).get("tenants", {})
    out = {}
    for name, run in arms.items():
        if name == "alone" or "summary" not in run:
            continue
        out[name] = {}
        for t in LIGHT:
            p99, ref = run["summary"]["tenants"][t]["latency_s"]["p99"], alone.get(t, {}).get("latency_s", {})
            out[name][t] = p99 / ref["p99"] if p99 is not None and ref.get("p99") else None
    return out


def pool_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per arm, the figures over every round's records together."""
    return {name: {"arm": rounds[0][name]["arm"], "killed_at_s": None,
                   "summary": summarize_arm([Record(**r) for arms in rounds for r in arms[name]["records"]],
                                            tuple(rounds[0][name]["arm"]["tenants"]))} for name in rounds[0]}


def targets(arms: dict[str, dict], ratios: dict[str, dict], order: dict | None) -> dict[str, bool | None]:
    """The issue's targets for the fair arm: light p99 <= 1.5x alone, Jain >= 0.95, none lost, order within 5 %."""
    fair = arms.get("fair", {}).get("summary")
    light = [ratios.get("fair", {}).get(t) for t in LIGHT]
    return {"light_p99_within_1.5x": None if None in light else max(light) <= 1.5,
            "jain_backlogged_0.95": None if not fair or fair["jain_backlogged"] is None
            else fair["jain_backlogged"] >= 0.95,
            "jain_share_0.95": None if not fair else fair["jain_share"] >= 0.95,
            "none_lost": None if not fair else all(a["summary"]["lost"] == 0 for a in arms.values()),
            "order_within_5pct": None if not order else order["two_replicas_vs_one"]["max_pct"] <= 5.0}


# ---- the run ------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the engine's model ('tiny': random 3 layers)")
    p.add_argument("--runtime", choices=("kvfleet", "vllm"), default="kvfleet", help="the engines: kvfleet's or vLLM")
    p.add_argument("--engines", type=int, default=1, choices=range(1, 5), help="engines (for vLLM: one core each)")
    p.add_argument("--engine-nice", type=int, default=10,
                   help="vLLM engines' niceness: they keep both cores busy, and a router waits for one (0: none)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per arm")
    p.add_argument("--flood", type=float, default=5.0, help="tenant A's rate as a multiple of capacity")
    p.add_argument("--light", type=float, default=0.1, help="B's and C's rate each, as a multiple of capacity")
    p.add_argument("--kill-at", type=float, default=0.4, help="when one replica gets SIGKILL, as a fraction of the run")
    p.add_argument("--max-queue-ms", type=int, default=15_000, help="the gateways' queue deadline")
    p.add_argument("--data-plane", choices=DATA_PLANES, default=GatewayConfig.data_plane,
                   help="the gateways' data plane (default: the gateway's own default)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--rounds", type=int, default=1, help="run the arms this many times, in alternating order")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="one more `kvfleet gateway` flag for every arm, e.g. --gateway-arg=--tenant-max-queued=50")
    p.add_argument("--calibrate-s", type=float, default=10.0, help="seconds of the capacity probe")
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order-only", action="store_true", help="only the order phase (needs Redis, no engine)")
    p.add_argument("--json", type=Path, help="write everything here; without it, a table only")
    args = p.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := [a for a in args.arms if a not in ARMS]:
        p.error(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if args.rounds < 1 or not 0 < args.kill_at < 1 or args.duration <= 0:
        p.error("--rounds must be >= 1, --kill-at in (0, 1) and --duration > 0")
    return args


def new_fleet(args: argparse.Namespace) -> BenchFleet:
    seqs = [args.max_num_seqs] * args.engines
    if args.runtime == "vllm":
        return BenchFleet(args.model, seqs, max_model_len=512, runtime="vllm", engine_nice=args.engine_nice,
                          engine_args=["--dtype", "bfloat16"])
    return BenchFleet(args.model, seqs, max_model_len=512, kv_cache_memory=args.kv_cache_memory)


def main() -> int:
    args = parse_args()
    report: dict = {"command": shlex.join(["python", "-m", "bench.noisy_neighbour", *sys.argv[1:]])}
    started = time.monotonic()
    if args.order_only:
        report["order"] = order_phase(None, args.seed)
    else:
        with new_fleet(args) as fleet:
            shape = LoadSpec(url=fleet.engines[0].url, prompt_words=args.prompt_words, max_tokens=args.max_tokens,
                             ignore_eos=True, model=MODEL_NAME, seed=args.seed + 99)
            capacity = asyncio.run(saturated_throughput({e.url: args.max_num_seqs for e in fleet.engines}, shape,
                                                        MODEL_NAME, args.calibrate_s))["requests_per_s"]
            rates = {"A": args.flood * capacity, "B": args.light * capacity, "C": args.light * capacity}
            print(f"capacity {capacity:.2f} req/s; rates " + ", ".join(f"{t} {r:.2f}" for t, r in rates.items()),
                  flush=True)
            plan = plan_tenants(rates, args.duration, args.prompt_words, args.seed)
            rounds = []
            for r in range(args.rounds):
                order = args.arms if r % 2 == 0 else args.arms[::-1]
                done = {name: run_arm(fleet, name, f"r{r}", plan, args) for name in order}
                rounds.append({name: done[name] for name in args.arms})
            report |= {"capacity_requests_per_s": capacity, "rates": rates, "rounds": rounds,
                       "p99_vs_alone": [light_p99_ratios(arms) for arms in rounds]}
            if args.rounds > 1:
                report["pooled"] = pool_rounds(rounds)
                report["pooled_p99_vs_alone"] = light_p99_ratios(report["pooled"])
            report["order"] = order_phase(fleet.redis.url, args.seed)
            final = report.get("pooled", rounds[-1])
            report["targets"] = targets(final, light_p99_ratios(final), report["order"])
    report["wall_s"] = time.monotonic() - started
    print(format_table(report, args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"JSON: {args.json}")
    return 0


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(report: dict, args: argparse.Namespace) -> str:
    lines = [report["command"]]
    if "rounds" in report:
        lines.append(f"{args.engines} {args.runtime} engine(s), max-num-seqs {args.max_num_seqs}; capacity "
                     f"{report['capacity_requests_per_s']:.2f} req/s; A {args.flood:g}x, B and C "
                     f"{args.light:g}x each; {args.duration:g} s; queue deadline {args.max_queue_ms} ms; one replica "
                     f"killed at {args.kill_at:.0%} in fcfs and fair; data plane {args.data_plane}")
    groups = [(f"round {r + 1}", arms, report["p99_vs_alone"][r]) for r, arms in enumerate(report.get("rounds", []))]
    if "pooled" in report:
        groups.append(("pooled", report["pooled"], report["pooled_p99_vs_alone"]))
    for label, arms, ratios in groups:
        lines += arm_rows(label, arms, ratios)
    o = report["order"]
    lines.append(f"order ({o['n']} entries): 2 replicas vs 1: mean {o['two_replicas_vs_one']['mean_pct']:.2f} %, "
                 f"max {o['two_replicas_vs_one']['max_pct']:.2f} % of N, {o['two_replicas_vs_one']['missing']} "
                 f"missing; in-process policy vs 1: mean {o['in_process_vs_one']['mean_pct']:.2f} %, "
                 f"max {o['in_process_vs_one']['max_pct']:.2f} %")
    if "targets" in report:
        lines.append("targets: " + ", ".join(f"{k} {'-' if v is None else 'met' if v else 'MISSED'}"
                                             for k, v in report["targets"].items()))
    lines.append(f"wall {report['wall_s']:.0f} s")
    return "\n".join(lines)


def arm_rows(label: str, arms: dict[str, dict], ratios: dict[str, dict]) -> list[str]:
    """One row per arm and tenant, then a line per arm: fairness and the kill."""
    lines = [f"{label:<9}{'arm':<21}{'tenant':<7}{'sent':>6}{'200':>6}{'429':>5}{'503':>5}{'other':>6}{'lost':>5}  "
             f"{'p50 s':>6}{'p90 s':>7}{'p99 s':>7}{'p99/alone':>10}{'tokens':>8}{'/share':>7}"]
    for name, run in arms.items():
        s = run["summary"]
        for t, x in s["tenants"].items():
            st, lat = x["status"], x["latency_s"]
            lines.append(f"{'':9}{name:<21}{t:<7}{x['sent']:>6}{st['200']:>6}{st['429']:>5}{st['503']:>5}"
                         f"{st['other']:>6}{st['lost']:>5}  {_s(lat['p50']):>6}{_s(lat['p90']):>7}{_s(lat['p99']):>7}"
                         f"{_s(ratios.get(name, {}).get(t)):>10}{x['served_tokens']:>8}"
                         f"{_s(x['served_over_share']):>7}")
        rt = s["retried"]
        lines.append(f"{'':9}{name:<21}backlogged {','.join(s['backlogged']) or '-'}: "
                     f"Jain {_s(s['jain_backlogged'])}; Jain over served/share {_s(s['jain_share'])}; "
                     f"answered {s['answered']}, lost {s['lost']}; retried {rt['connect']} (could not connect) + "
                     f"{rt['connection lost']} (in flight at the kill), {rt['answered']} of them answered"
                     + (f"; killed at {run['killed_at_s']:.1f} s" if run["killed_at_s"] is not None else ""))
    return lines


if __name__ == "__main__":
    sys.exit(main())
