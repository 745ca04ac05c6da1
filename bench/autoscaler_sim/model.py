"""The simulated fleet and its loop: engine pods calibrated from the engine benchmark, the gateway in front of
them, and simulate(), which runs a trace second by second under a policy.

Engine pods are calibrated from the engine benchmark (SmolLM2-135M on 2 CPU cores: 64 requests of the Anyscale
shape in 52.8 s, i.e. 1.2 requests/s at a full batch of 64, prefill included): each pod runs up to max_num_seqs
requests at once with processor-shared decode whose throughput grows with the batch (half its asymptote at 25
sequences, from the step-time split), prefills one prompt at a time (~480 tokens/s) while decoding pauses, queues
the rest, and reports KV usage = running × a per-request share; a request whose prefill has not started counts as
waiting. Pods are ready after a cold start and drain when scaled down (draining and starting pods count in
replica-seconds). The gateway routes to the least-loaded ready pod and holds requests in its queue while every pod
is saturated (waiting >= 5 or KV >= 0.8) or none is ready. TTFT = gateway wait + pod wait + prefill.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from bench.autoscaler_sim.report import SimResult
from bench.autoscaler_sim.workloads import MEAN_PROMPT_TOKENS, Trace
from kvfleet.operator.autoscaler import PodLoad


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


class Policy(Protocol):
    """An autoscaler as the simulation drives it: the replicas it wants, given what it sees."""

    def desired(self, view: FleetView) -> int: ...


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
