"""Autoscaling policies on a simulated fleet: kvfleet's recommend() vs a KEDA queue-length policy vs HPA on
request rate, side by side on the same seeded bursty traces.

    python -m bench.autoscaler_sim --out bench/results          # ~20 s
    python -m bench.autoscaler_sim --replot bench/results/autoscaler_sim.json

Discrete time, 1 s steps, pure Python, no processes. Engine pods are calibrated from the engine benchmark
(SmolLM2-135M on 2 CPU cores: 64 requests of the Anyscale shape in 52.8 s, i.e. 1.2 requests/s at a full batch of
64, prefill included): each pod runs up to max_num_seqs requests at once with processor-shared decode whose
throughput grows with the batch (half its asymptote at 25 sequences, from the step-time split), prefills one
prompt at a time (~480 tokens/s) while decoding pauses, queues the rest, and reports KV usage = running × a
per-request share; a request whose prefill has not started counts as waiting. Pods are ready after a cold start
and drain when scaled down (draining and starting pods count in replica-seconds). The gateway routes to the
least-loaded ready pod and holds requests in its queue while every pod is saturated (waiting >= 5 or KV >= 0.8)
or none is ready. TTFT = gateway wait + pod wait + prefill; SLO: TTFT <= 2 s.

Traces: a day squeezed into 2 hours (1 to 4 requests/s), 20 idle minutes (longer than the 10 it takes the default
policy to reach zero), and 5 bursts of 5-10× for 30-120 s; figures pool several seeds because a burst's outcome
depends on how many pods a policy happens to hold when it hits. Every policy polls every 15 s with maxReplicas 64.
The queue-length policy counts the gateway's queue as waiting: vLLM production-stack's router has no queue and
would have sent those requests to the engines, where vllm:num_requests_waiting counts them.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

from bench.plotting import finish, pyplot
from kvfleet.operator.autoscaler import AutoscalerState, AutoscalingPolicy, Observation, PodLoad, recommend

SLO_TTFT_S = 2.0
TARGET_SLO = 0.99
TARGET_REPLICA_RATIO = 0.8
MEAN_PROMPT_TOKENS = 136  # uniform 16-256, the engine benchmark's prompts
_EXP_CAP = 4.0  # decode work ~ Exp(1) capped at 4× the mean (the benchmark's outputs: mean 64, capped at 256)


@dataclass(frozen=True)
class EngineModel:
    capacity_rps: float = 1.2  # requests/s at a full batch, prefill included (engine bench: 64 in 52.8 s)
    max_num_seqs: int = 64
    prefill_tokens_per_s: float = 480.0  # engine bench: 8,332 prompt tokens in ~17 s of prefill steps
    half_rate_batch: float = 25.0  # decode gives half its asymptote at this batch (0.074 s + 2.9 ms/seq steps)
    kv_per_request: float = 0.011  # ~11 of the 1,024 blocks at the mean context of the shape
    cold_start_s: int = 30  # image pull and model load

    def __post_init__(self) -> None:
        if self.capacity_rps <= 0 or self.max_num_seqs < 1 or self.half_rate_batch < 0 or self.cold_start_s < 0:
            raise ValueError("capacity_rps and max_num_seqs must be positive, half_rate_batch and cold_start_s >= 0")
        if self.capacity_rps * self.mean_prefill_s >= 1:
            raise ValueError(f"{self.capacity_rps} requests/s would leave no time to decode after "
                             f"{self.mean_prefill_s:.2f} s prefills; lower capacity_rps")

    @property
    def mean_prefill_s(self) -> float:
        return MEAN_PROMPT_TOKENS / self.prefill_tokens_per_s

    @cached_property
    def decode_rps(self) -> list[float]:
        """Mean-sized requests finished per second of decoding, by the number running."""
        full = self.capacity_rps / (1 - self.capacity_rps * self.mean_prefill_s)  # decode-only rate at a full batch
        h, m = self.half_rate_batch, self.max_num_seqs
        return [full * n * (m + h) / (m * (n + h)) for n in range(m + 1)]


@dataclass(frozen=True)
class Trace:
    duration_s: int
    rates: tuple[float, ...]  # the intended arrival rate of each second
    arrivals: tuple[tuple[float, int, float], ...]  # (time, prompt tokens, decode work in mean requests), sorted
    bursts: tuple[tuple[int, int, float], ...] = ()  # (start, end, factor)

    def in_burst(self, at: float) -> bool:
        return any(start <= at < end for start, end, _ in self.bursts)


def bursty_trace(seed: int = 0, duration_s: int = 7200, low_rps: float = 1.0, peak_rps: float = 4.0,
                 bursts: int = 5, burst_factor: tuple[float, float] = (5.0, 10.0),
                 burst_s: tuple[int, int] = (30, 120), idle: tuple[int, int] = (1200, 2400)) -> Trace:
    """A day squeezed into the trace (low, peak mid-way, low again), an idle stretch, and sharp bursts that
    multiply the base rate; Poisson arrivals."""
    rng = random.Random(seed)
    rates = [low_rps + (peak_rps - low_rps) * 0.5 * (1 - math.cos(2 * math.pi * t / duration_s))
             for t in range(duration_s)]
    for t in range(*idle):
        rates[t] = 0.0
    taken, placed = [(idle[0] - 60, idle[1] + 60)], []
    for _ in range(bursts):
        for _attempt in range(1000):
            length = rng.randint(*burst_s)
            start = rng.randrange(60, duration_s - length - 60)
            if all(start + length + 180 < a or start > b + 180 for a, b in taken):
                break
        else:
            raise ValueError(f"no room for {bursts} bursts of up to {burst_s[1]} s in {duration_s} s")
        taken.append((start, start + length))
        factor = rng.uniform(*burst_factor)
        placed.append((start, start + length, factor))
        for t in range(start, start + length):
            rates[t] *= factor
    return Trace(duration_s, tuple(rates), _poisson(rates, rng), tuple(sorted(placed)))


def constant_trace(rate: float, duration_s: int) -> Trace:
    """Evenly spaced mean-sized requests: a load with no randomness at all."""
    count = int(rate * duration_s)
    arrivals = tuple((k / rate, MEAN_PROMPT_TOKENS, 1.0) for k in range(count))
    return Trace(duration_s, (rate,) * duration_s, arrivals)


def _poisson(rates: list[float], rng: random.Random) -> tuple[tuple[float, int, float], ...]:
    arrivals = []
    for second, rate in enumerate(rates):
        at = second + (rng.expovariate(rate) if rate > 0 else 1.0)
        while at < second + 1:
            work = min(rng.expovariate(1.0), _EXP_CAP) / (1 - math.exp(-_EXP_CAP))
            arrivals.append((at, rng.randint(16, 256), work))
            at += rng.expovariate(rate)
    return tuple(arrivals)


_IDLE = PodLoad(0.0, 0, 0)


@dataclass(slots=True)
class Request:
    rid: int
    arrival: float
    prefill_s: float
    work: float
    first_token: float | None = None
    done: bool = False


class Pod:
    """One engine: processor-shared decode over its batch; prompts prefill one at a time and decoding pauses while
    they do. A request whose prefill has not started counts as waiting in the metrics, as in vLLM's scheduler."""

    def __init__(self, engine: EngineModel, ready_at: float) -> None:
        self.engine, self.ready_at, self.draining = engine, ready_at, False
        self.running: list[tuple[float, int, Request]] = []  # heap by the decode progress at which each ends
        self.waiting: deque[Request] = deque()  # beyond max_num_seqs
        self.prefill_starts: deque[float] = deque()  # of admitted requests, in order; trimmed by metrics()
        self.progress = 0.0  # decode work every running request has received since the pod started
        self.prefill_free_at = 0.0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def metrics(self, now: float) -> PodLoad:
        """What its /metrics would say now: KV usage, running, waiting."""
        if not self.running:
            return _IDLE
        while self.prefill_starts and self.prefill_starts[0] <= now:
            self.prefill_starts.popleft()
        pending = len(self.prefill_starts)
        running = len(self.running) - pending
        return PodLoad(running * self.engine.kv_per_request, running, len(self.waiting) + pending)

    def advance(self, start: float, end: float, arrivals: list[tuple[float, Request]]) -> None:
        """Serve from start to end, taking the arrivals (time-ordered) as they come."""
        if not self.running and not arrivals:
            return
        now, i = start, 0
        while True:
            n = len(self.running)
            next_arrival = arrivals[i][0] if i < len(arrivals) else end
            finish, per_request = math.inf, 0.0
            if n:
                per_request = self.engine.decode_rps[n] / n
                decoding_from = max(now, self.prefill_free_at)
                finish = decoding_from + max(0.0, self.running[0][0] - self.progress) / per_request
            at = min(next_arrival, finish)
            if n:
                self.progress += per_request * max(0.0, at - max(now, self.prefill_free_at))
            now = at
            if finish <= next_arrival:
                heapq.heappop(self.running)[2].done = True
                if self.waiting:
                    self._admit(self.waiting.popleft(), now)
            elif i < len(arrivals):
                request = arrivals[i][1]
                i += 1
                if n < self.engine.max_num_seqs:
                    self._admit(request, now)
                else:
                    self.waiting.append(request)
            else:
                return

    def _admit(self, request: Request, now: float) -> None:
        heapq.heappush(self.running, (self.progress + request.work, request.rid, request))
        start = max(now, self.prefill_free_at)
        self.prefill_starts.append(start)
        self.prefill_free_at = start + request.prefill_s
        request.first_token = self.prefill_free_at


@dataclass(frozen=True)
class FleetView:
    """What a policy sees at a decision: the Deployment's replicas, its ready pods' metrics, the gateway queue."""

    time: float
    replicas: int
    pods: tuple[PodLoad, ...]
    gateway_queued: int
    arrivals_per_s: float  # over the last minute, as Prometheus rate(...[1m]) would give it


class Fleet:
    """Engine pods behind a gateway that routes to the least-loaded ready pod and queues while all are saturated."""

    def __init__(self, engine: EngineModel, replicas: int, saturation_waiting: int = 5,
                 saturation_kv: float = 0.8) -> None:
        self.engine, self.saturation_waiting, self.saturation_kv = engine, saturation_waiting, saturation_kv
        self.pods = [Pod(engine, 0.0) for _ in range(replicas)]
        self.queue: deque[Request] = deque()
        self.arrivals_per_second: list[int] = []

    @property
    def replicas(self) -> int:
        return sum(1 for p in self.pods if not p.draining)

    def ready_pods(self, now: float) -> list[Pod]:
        return [p for p in self.pods if not p.draining and p.ready_at <= now]

    def view(self, now: float) -> FleetView:
        recent = self.arrivals_per_second[-60:]
        return FleetView(now, self.replicas, tuple(p.metrics(now) for p in self.ready_pods(now)), len(self.queue),
                         sum(recent) / max(1, len(recent)))

    def scale_to(self, desired: int, now: float) -> None:
        """New pods start cold; removal takes pods not yet ready first, then the least-loaded, which drain."""
        live = [p for p in self.pods if not p.draining]
        for _ in range(desired - len(live)):
            self.pods.append(Pod(self.engine, now + self.engine.cold_start_s))
        if desired < len(live):
            for pod in sorted(live, key=lambda p: (p.ready_at <= now, p.load, -p.ready_at))[:len(live) - desired]:
                if pod.ready_at > now:
                    self.pods.remove(pod)
                else:
                    pod.draining = True

    def step(self, now: float, arrivals: list[Request]) -> None:
        """One second: route the gateway's queue (first come, first served) and the new arrivals, then serve."""
        self.arrivals_per_second.append(len(arrivals))
        scraped = [(p, p.metrics(now)) for p in self.ready_pods(now)]
        sent: list[list[tuple[float, Request]]] = [[] for _ in scraped]
        heap = [(m.running + m.waiting, k) for k, (_, m) in enumerate(scraped)]
        heapq.heapify(heap)
        pending = [(now, r) for r in self.queue] + [(r.arrival, r) for r in arrivals]
        self.queue.clear()
        for at, request in pending:
            while heap and self._saturated(*scraped[heap[0][1]], len(sent[heap[0][1]]), now):
                heapq.heappop(heap)  # saturated pods stay so until the next scrape
            if not heap:
                self.queue.append(request)
                continue
            load, k = heapq.heappop(heap)
            sent[k].append((at, request))
            heapq.heappush(heap, (load + 1, k))
        by_pod = {id(p): s for (p, _), s in zip(scraped, sent, strict=True)}
        for pod in self.pods:
            if pod.ready_at <= now:
                pod.advance(now, now + 1, by_pod.get(id(pod), []))
        self.pods = [p for p in self.pods if not (p.draining and p.load == 0)]

    def _saturated(self, pod: Pod, scraped: PodLoad, sent: int, now: float) -> bool:
        """The gateway's view: the last scrape, plus what it sent since beyond the prompts the pod can begin."""
        starts = (now + 1 - max(now, pod.prefill_free_at)) / self.engine.mean_prefill_s
        room = self.engine.max_num_seqs - len(pod.running)
        started = max(0, min(sent, room, int(starts)))
        waiting, running = scraped.waiting + sent - started, scraped.running + started
        return waiting >= self.saturation_waiting or running * self.engine.kv_per_request >= self.saturation_kv


class KvfleetPolicy:
    """kvfleet's operator: recommend() on the ready pods' metrics and the gateway's queue."""

    def __init__(self, policy: AutoscalingPolicy) -> None:
        self.policy, self.state = policy, AutoscalerState()

    def desired(self, view: FleetView) -> int:
        obs = Observation(view.time, view.replicas, view.pods, view.gateway_queued)
        return recommend(obs, self.policy, self.state).desired


@dataclass
class HpaPolicy:
    """Kubernetes HPA on one external metric with an AverageValue target and the default behavior: tolerance,
    a scale-down window seeded with the initial size, scale-up at most max(+100 %, +4 pods) per period."""

    metric: Callable[[FleetView], float]
    target: float  # per replica
    min_replicas: int = 1
    max_replicas: int = 64
    tolerance: float = 0.1
    scale_down_stabilization_s: float = 300.0
    history: list[tuple[float, int]] = field(default_factory=list)

    def desired(self, view: FleetView) -> int:
        now, current = view.time, max(view.replicas, 1)
        if not self.history:
            self.history.append((now, view.replicas))
        total = self.metric(view)
        ratio = total / (self.target * current)
        raw = current if abs(ratio - 1) <= self.tolerance else math.ceil(total / self.target - 1e-9)
        raw = min(self.max_replicas, max(self.min_replicas, raw))
        self.history = [(t, r) for t, r in self.history if t > now - self.scale_down_stabilization_s]
        self.history.append((now, raw))
        if raw < current:
            raw = min(current, max(r for _, r in self.history))
        return min(raw, max(2 * current, current + 4))


Policy = KvfleetPolicy | HpaPolicy


def queue_length_hpa(max_replicas: int, per_replica: float = 5.0) -> HpaPolicy:
    """vLLM production-stack's KEDA default: sum(vllm:num_requests_waiting) / 5. Without kvfleet's gateway queue
    its router would have sent the gateway's queued requests to the engines, so they count as waiting."""
    return HpaPolicy(lambda v: sum(p.waiting or 0 for p in v.pods) + v.gateway_queued, per_replica,
                     max_replicas=max_replicas)


def request_rate_hpa(max_replicas: int, per_replica: float) -> HpaPolicy:
    return HpaPolicy(lambda v: v.arrivals_per_s, per_replica, max_replicas=max_replicas)


@dataclass
class SimResult:
    ttfts: list[float]  # inf for requests without a first token when the simulation stopped
    in_burst: list[bool]  # whether each request arrived during a burst
    replicas: list[int]  # the Deployment's replicas at each second of the trace
    pods: list[int]  # every pod that costs: starting, ready, draining
    completed: int
    in_pods: int  # running or waiting in a pod when the simulation stopped
    gateway_queued: int

    def summary(self) -> dict:
        ordered = sorted(self.ttfts)
        burst = [t for t, b in zip(self.ttfts, self.in_burst, strict=True) if b]
        calm = [t for t, b in zip(self.ttfts, self.in_burst, strict=True) if not b]
        return {"requests": len(ordered), "slo_attainment": _attainment(ordered),
                "slo_in_bursts": _attainment(burst), "slo_outside_bursts": _attainment(calm),
                "requests_in_bursts": len(burst),
                "replica_seconds": sum(self.pods), "mean_replicas": sum(self.pods) / max(1, len(self.pods)),
                "max_replicas": max(self.replicas, default=0),
                "ttft_p50_s": _quantile(ordered, 0.5), "ttft_p99_s": _quantile(ordered, 0.99),
                "ttft_max_s": _finite_or_none(ordered[-1]) if ordered else None,
                "no_first_token": sum(1 for t in ordered if math.isinf(t))}

    @staticmethod
    def pooled(results: list[SimResult]) -> SimResult:
        """Several traces' results as one: requests and seconds side by side."""
        return SimResult([t for r in results for t in r.ttfts], [b for r in results for b in r.in_burst],
                         [n for r in results for n in r.replicas], [n for r in results for n in r.pods],
                         sum(r.completed for r in results), sum(r.in_pods for r in results),
                         sum(r.gateway_queued for r in results))


def simulate(trace: Trace, policy: Policy, engine: EngineModel = EngineModel(),
             initial_replicas: int = 2, period_s: int = 15, tail_s: int = 1800) -> SimResult:
    """Run the trace, deciding every period_s; after it, run on with no arrivals (for at most tail_s) until every
    request has its first token. Replicas are counted over the trace only."""
    fleet = Fleet(engine, initial_replicas)
    requests = [Request(k, at, prompt / engine.prefill_tokens_per_s, work)
                for k, (at, prompt, work) in enumerate(trace.arrivals)]
    replicas, pods, next_arrival, now = [], [], 0, 0
    while now < trace.duration_s or (now < trace.duration_s + tail_s and _unstarted(fleet)):
        if now % period_s == 0:
            fleet.scale_to(policy.desired(fleet.view(now)), now)
        if now < trace.duration_s:
            replicas.append(fleet.replicas)
            pods.append(len(fleet.pods))
        first = next_arrival
        while next_arrival < len(requests) and requests[next_arrival].arrival < now + 1:
            next_arrival += 1
        fleet.step(now, requests[first:next_arrival])
        now += 1
    ttfts = [r.first_token - r.arrival if r.first_token is not None else math.inf for r in requests]
    return SimResult(ttfts, [trace.in_burst(r.arrival) for r in requests], replicas, pods,
                     sum(1 for r in requests if r.done), sum(p.load for p in fleet.pods), len(fleet.queue))


def _unstarted(fleet: Fleet) -> bool:
    return bool(fleet.queue) or any(p.waiting for p in fleet.pods)


def _attainment(ttfts: list[float]) -> float | None:
    return sum(1 for t in ttfts if t <= SLO_TTFT_S) / len(ttfts) if ttfts else None


def _quantile(ordered: list[float], q: float) -> float | None:
    return _finite_or_none(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else None


def _finite_or_none(value: float) -> float | None:
    return None if math.isinf(value) else value


def policies(max_replicas: int, engine: EngineModel, rate_fraction: float) -> dict[str, Callable[[], Policy]]:
    """The compared policies, as factories (each simulation needs a fresh state)."""
    kvfleet = AutoscalingPolicy(min_replicas=1, max_replicas=max_replicas)
    return {
        "kvfleet (min 1)": lambda: KvfleetPolicy(kvfleet),
        "kvfleet (min 0)": lambda: KvfleetPolicy(replace(kvfleet, min_replicas=0)),
        "queue length (KEDA)": lambda: queue_length_hpa(max_replicas),
        "HPA on request rate": lambda: request_rate_hpa(max_replicas, rate_fraction * engine.capacity_rps),
    }


def sweep_variants(max_replicas: int) -> dict[str, AutoscalingPolicy]:
    """kvfleet policies with other parameters, for when the default misses the target."""
    default = AutoscalingPolicy(min_replicas=1, max_replicas=max_replicas)
    return {
        "targets KV 0.4, queue 1": replace(default, target_kv_usage=0.4, target_queue_per_replica=1.0),
        "down window 60 s": replace(default, scale_down_stabilization_s=60.0),
        "up x4 per period": replace(default, max_scale_up_factor=4.0),
        **{f"min {n}": replace(default, min_replicas=n) for n in (8, 16, 20, 24)},
        "min 16, down window 60 s": replace(default, min_replicas=16, scale_down_stabilization_s=60.0),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="of the first trace (the one charted over time)")
    parser.add_argument("--seeds", type=int, default=3, help="traces (seed, seed+1, ...); figures pool them")
    parser.add_argument("--duration", type=int, default=7200, help="seconds of simulated traffic per trace")
    parser.add_argument("--capacity", type=float, default=1.2, help="requests/s of one pod at a full batch")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cold-start", type=int, default=30, help="seconds before a new pod is ready")
    parser.add_argument("--max-replicas", type=int, default=64, help="for every policy")
    parser.add_argument("--rate-target", type=float, default=0.7,
                        help="HPA on request rate: target per replica as a fraction of a pod's capacity")
    parser.add_argument("--no-sweep", action="store_true", help="skip the kvfleet parameter sweep")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--replot", type=Path, help="redraw the chart of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.seeds < 1 or args.duration < 600:
        parser.error("--seeds must be >= 1 and --duration >= 600")
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        chart(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    started = time.monotonic()
    try:
        engine = EngineModel(capacity_rps=args.capacity, max_num_seqs=args.max_num_seqs,
                             cold_start_s=args.cold_start)
    except ValueError as error:
        sys.exit(f"autoscaler_sim: {error}")
    traces = [bursty_trace(seed=args.seed + k, duration_s=args.duration) for k in range(args.seeds)]
    runs = {name: _compare(traces, make, engine) for name, make in
            policies(args.max_replicas, engine, args.rate_target).items()}
    queue = runs["queue length (KEDA)"]
    for run in runs.values():
        _relate(run, queue)
    sweep = {}
    if not args.no_sweep and not runs["kvfleet (min 1)"]["meets_target"]:
        for name, policy in sweep_variants(args.max_replicas).items():
            sweep[name] = _compare(traces, lambda policy=policy: KvfleetPolicy(policy), engine, detail=False)
            _relate(sweep[name], queue)
    report = {
        "command": shlex.join(["python", "-m", "bench.autoscaler_sim", *sys.argv[1:]]),
        "engine": asdict(engine), "seeds": [args.seed + k for k in range(args.seeds)], "duration_s": args.duration,
        "requests": sum(len(t.arrivals) for t in traces), "bursts": [list(t.bursts) for t in traces],
        "max_replicas": args.max_replicas, "rate_target_per_replica": args.rate_target * engine.capacity_rps,
        "slo_ttft_s": SLO_TTFT_S,
        "target": {"slo_attainment": TARGET_SLO, "replica_seconds_vs_queue": TARGET_REPLICA_RATIO},
        "arrivals_per_s": _per_second(traces[0]), "runs": runs, "sweep": sweep,
        "wall_s": time.monotonic() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "autoscaler_sim.json"
    path.write_text(json.dumps(report))
    print(format_table(report))
    print(f"JSON: {path}   chart: {chart(report, path.with_suffix('.png'))}")


def _compare(traces: list[Trace], make: Callable[[], Policy], engine: EngineModel, detail: bool = True) -> dict:
    """One policy on every trace: pooled figures, per-trace figures, and (detail) what the chart needs."""
    results = [simulate(trace, make(), engine) for trace in traces]
    run = SimResult.pooled(results).summary() | {"per_trace": [r.summary() for r in results]}
    if detail:
        run |= {"replicas": results[0].replicas, "ttft_quantiles": _cdf(SimResult.pooled(results).ttfts)}
    return run


def _relate(run: dict, queue: dict) -> None:
    run["replica_seconds_vs_queue"] = run["replica_seconds"] / queue["replica_seconds"]
    for mine, theirs in zip(run["per_trace"], queue["per_trace"], strict=True):
        mine["replica_seconds_vs_queue"] = mine["replica_seconds"] / theirs["replica_seconds"]
    run["meets_target"] = run["slo_attainment"] >= TARGET_SLO and run["replica_seconds_vs_queue"] <= \
        TARGET_REPLICA_RATIO


def _cdf(ttfts: list[float], points: int = 500) -> list[float | None]:
    ordered = sorted(ttfts)
    return [_finite_or_none(ordered[min(len(ordered) - 1, round(k * (len(ordered) - 1) / points))])
            for k in range(points + 1)] if ordered else []


def _per_second(trace: Trace) -> list[int]:
    counts = [0] * trace.duration_s
    for at, _, _ in trace.arrivals:
        counts[int(at)] += 1
    return counts


def format_table(report: dict) -> str:
    header = (f"{'policy':<26} {'SLO met':>8} {'in bursts':>9} {'outside':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'replica-s':>10} {'mean':>5} {'max':>4} {'÷ queue':>8}  per trace ÷ queue")
    kv = report["runs"]["kvfleet (min 1)"]
    engine = report["engine"]
    in_bursts = sum(t["requests_in_bursts"] for t in kv["per_trace"])
    lines = [f"\n{report['command']}",
             f"{len(report['seeds'])} traces (seeds {', '.join(map(str, report['seeds']))}) of "
             f"{report['duration_s']} s: {report['requests']} requests, {in_bursts / report['requests']:.0%} of "
             f"them in bursts; pods of {engine['capacity_rps']} req/s at a batch of {engine['max_num_seqs']}, cold "
             f"start {engine['cold_start_s']} s; SLO TTFT <= {report['slo_ttft_s']:g} s. Figures pool the traces.",
             header, *(_row(name, run) for name, run in report["runs"].items())]
    for name in ("kvfleet (min 1)", "kvfleet (min 0)"):
        run = report["runs"][name]
        lines.append(f"{name}: replica-seconds / queue policy's = {run['replica_seconds_vs_queue']:.2f}, SLO "
                     f"{run['slo_attainment']:.2%}; target >= {TARGET_SLO:.0%} at <= {TARGET_REPLICA_RATIO}x: "
                     f"{'met' if run['meets_target'] else 'NOT met'}")
    if report["sweep"]:
        meeting = [name for name, s in report["sweep"].items() if s["meets_target"]]
        reaching = [(s["replica_seconds_vs_queue"], name) for name, s in report["sweep"].items()
                    if s["slo_attainment"] >= TARGET_SLO]
        lines += ["kvfleet with other parameters (everything else default):", header.replace("policy  ", "variant "),
                  *(_row(name, s) for name, s in report["sweep"].items()),
                  "meets the target: " + (", ".join(meeting) if meeting else "none of these"),
                  "cheapest to reach the SLO: " + (f"{min(reaching)[1]} at {min(reaching)[0]:.2f}x the queue "
                                                  "policy's replica-seconds" if reaching else "none of these")]
    lines.append(f"simulated in {report['wall_s']:.1f} s")
    return "\n".join(lines)


def _row(name: str, run: dict) -> str:
    per_trace = " ".join(f"{t['replica_seconds_vs_queue']:.2f}" for t in run["per_trace"])
    return (f"{name:<26} {run['slo_attainment']:>8.2%} {_pct(run['slo_in_bursts']):>9} "
            f"{_pct(run['slo_outside_bursts']):>8} {_s(run['ttft_p50_s']):>9} {_s(run['ttft_p99_s']):>9} "
            f"{run['replica_seconds']:>10,} {run['mean_replicas']:>5.1f} {run['max_replicas']:>4} "
            f"{run['replica_seconds_vs_queue']:>8.2f}  {per_trace}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}s"


COLORS = {"kvfleet (min 1)": "tab:green", "kvfleet (min 0)": "tab:olive", "queue length (KEDA)": "tab:blue",
          "HPA on request rate": "tab:purple"}


def chart(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (over_time, cdf) = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [2.2, 1]})
    load = over_time.twinx()
    arrivals = report["arrivals_per_s"]
    smooth = [sum(arrivals[max(0, t - 9):t + 1]) / len(arrivals[max(0, t - 9):t + 1]) for t in range(len(arrivals))]
    load.fill_between([t / 60 for t in range(len(smooth))], smooth, color="0.85", step="post", zorder=0)
    load.set_ylabel("arrivals (requests/s, 10 s mean)", color="0.4")
    over_time.set_zorder(load.get_zorder() + 1)
    over_time.patch.set_visible(False)
    for name, run in report["runs"].items():
        label = (f"{name}: {run['per_trace'][0]['slo_attainment']:.1%} SLO, "
                 f"{run['per_trace'][0]['replica_seconds_vs_queue']:.2f}x queue's replica-s on this trace")
        over_time.step([t / 60 for t in range(len(run["replicas"]))], run["replicas"], where="post", lw=1.1,
                       color=COLORS.get(name), label=label)
        ttfts = [v for v in run["ttft_quantiles"] if v is not None]
        fractions = [k / (len(run["ttft_quantiles"]) - 1) for k in range(len(ttfts))]
        cdf.plot([max(v, 1e-2) for v in ttfts], fractions, color=COLORS.get(name), label=name)
    over_time.set(xlabel="minutes", ylabel="replicas ordered",
                  title=f"replicas per policy over the trace of seed {report['seeds'][0]}")
    over_time.legend(fontsize=8, loc="upper left")
    cdf.axvline(report["slo_ttft_s"], color="tab:red", ls="--", lw=1, label=f"SLO {report['slo_ttft_s']:g} s")
    cdf.set(xscale="log", xlabel="TTFT (s, log scale)", ylabel="fraction of requests",
            title=f"TTFT CDF, {len(report['seeds'])} traces pooled")
    cdf.legend(fontsize=8, loc="lower right")
    kv = report["runs"]["kvfleet (min 1)"]
    fig.suptitle(f"{report['requests']} requests in {len(report['seeds'])} traces, cold start "
                 f"{report['engine']['cold_start_s']} s; kvfleet (min 1): {kv['slo_attainment']:.2%} within "
                 f"{report['slo_ttft_s']:g} s at {kv['replica_seconds_vs_queue']:.2f}x the queue policy's replica-"
                 f"seconds (target >= {TARGET_SLO:.0%} at <= {TARGET_REPLICA_RATIO}x: "
                 f"{'met' if kv['meets_target'] else 'not met'})")
    return finish(fig, path, (over_time, cdf), legend_fontsize=None)


if __name__ == "__main__":
    main()
