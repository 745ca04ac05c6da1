"""The simulation loop: one arrival trace through R gateway replicas (or the oracle) to E engines, event by event.

Events are arrivals (each replica takes every R-th request, as a load balancer in front would spread them), engine
step ends, and replica scrapes (every 75 ms, replica r offset by r/R of the period). A request that finds every
engine saturated waits in its replica's queue and is released at that replica's next scrapes, as many as the fleet
has free slots (gateway/routing/pick.py free_slots), routed with must=True like the gateway's queue releases.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from bench.prefix_sim.calibrate import Calibration
from bench.prefix_sim.engine import EngineShape, Job, SimEngine, new_sequence
from bench.prefix_sim.gateway import EVENT_POLICIES, ORACLES, Oracle, Replica, prompt_body
from bench.prefix_sim.peers import SGLANG, SGLangCacheAware
from bench.prefix_sim.workload import Arrival

SCRAPE_PERIOD_S = 0.075
_ARRIVAL, _STEP, _SCRAPE = 0, 1, 2


@dataclass(frozen=True)
class FleetShape:
    engines: int = 64
    replicas: int = 8
    event_delay_s: tuple[float, float] = (0.005, 0.05)  # each (replica, engine) stream's delay, uniform
    engine: EngineShape = EngineShape()

    def __post_init__(self) -> None:
        if self.engines < 1 or self.replicas < 1:
            raise ValueError("engines and replicas must be >= 1")
        low, high = self.event_delay_s
        if not 0 <= low <= high:
            raise ValueError("event_delay_s is (low, high) with 0 <= low <= high")


@dataclass
class Run:
    """What one policy did with one trace: every request's journey, the engines and replicas at the end."""

    policy: str
    jobs: list[Job]
    engines: list[SimEngine]
    routers: list  # Replica, or the one Oracle
    end_s: float  # simulated time when the run stopped


def simulate(trace: list[Arrival], policy: str, fleet: FleetShape, calibration: Calibration, duration_s: float,
             seed: int = 0, drain_s: float = 30.0) -> Run:
    """Run the trace under policy; after duration_s, go on without arrivals until every request has its first token
    (at most drain_s more)."""
    rng = random.Random(seed)
    engines = [SimEngine(k, fleet.engine, calibration, events=policy in EVENT_POLICIES) for k in range(fleet.engines)]
    clock = [0.0]
    if policy in ORACLES:
        routers: list = [Oracle(engines, seed, policy)]
    elif policy == SGLANG:
        routers = [SGLangCacheAware(engines, seed * 1000 + r, fleet.engine.block_size) for r in range(fleet.replicas)]
    else:
        routers = [Replica(r, policy, engines, lambda: clock[0],
                           [rng.uniform(*fleet.event_delay_s) for _ in engines], seed * 1000 + r)
                   for r in range(fleet.replicas)]
    heap: list[tuple[float, int, int, int]] = [(r * SCRAPE_PERIOD_S / len(routers), 0, _SCRAPE, r)
                                               for r in range(len(routers))]
    for router in routers:
        router.scrape(0.0)
    order = len(heap)
    jobs = [Job(a, new_sequence(a)) for a in trace]
    waiting_first = len(jobs)
    next_arrival = 0

    def dispatch(job: Job, k: int, now: float) -> None:
        nonlocal order
        job.engine, job.dispatched_at = k, now
        engine = engines[k]
        engine.enqueue(job)
        if not engine.busy:
            step = engine.start_step()
            if step is not None:
                order += 1
                heapq.heappush(heap, (now + step, order, _STEP, k))

    while True:
        if next_arrival < len(jobs) and (not heap or jobs[next_arrival].arrival.at <= heap[0][0]):
            job = jobs[next_arrival]
            now, kind, arg = job.arrival.at, _ARRIVAL, next_arrival
            next_arrival += 1
        elif heap:
            now, _, kind, arg = heapq.heappop(heap)
        else:
            break
        clock[0] = now
        if kind == _ARRIVAL:
            job = jobs[arg]
            if getattr(routers[0], "prefix", None) is not None:
                job.meta["body"] = prompt_body(job.arrival.token_ids)
            router = routers[arg % len(routers)]
            k = router.route(job, now) if not router.queue else None
            if k is None:
                router.queue.append(job)
            else:
                dispatch(job, k, now)
        elif kind == _STEP:
            engine = engines[arg]
            waiting_first -= len(engine.admitted)
            for finished in engine.finish_step(now):
                if "replica" in finished.meta:
                    finished.meta["replica"].done(finished)
            step = engine.start_step()
            if step is not None:
                order += 1
                heapq.heappush(heap, (now + step, order, _STEP, arg))
        else:
            router = routers[arg]
            router.scrape(now)
            for _ in range(router.releasable(now)):
                if not router.queue:
                    break
                k = router.route(router.queue[0], now, must=True)
                if k is None:
                    break
                dispatch(router.queue.popleft(), k, now)
            if now < duration_s or (waiting_first > 0 and now < duration_s + drain_s):
                order += 1
                heapq.heappush(heap, (now + SCRAPE_PERIOD_S, order, _SCRAPE, arg))
            if policy in EVENT_POLICIES and arg == 0:
                for k, engine in enumerate(engines):
                    engine.trim_log(min(r.cursors[k] for r in routers))
        if now >= duration_s + drain_s or (now >= duration_s and waiting_first == 0):
            break
    return Run(policy, jobs, engines, routers, clock[0])


def fleet_capacity_rps(fleet: FleetShape, mean_prompt: float, mean_system: float, mean_output: float,
                       calibration: Calibration, miss: float) -> float:
    """Requests/s the fleet serves at full batches when a share `miss` of system-prompt tokens is not cached: each
    request costs its uncached prefill (question, the partial last block, missed system tokens) plus its share of
    full-batch decode steps. Load fractions are of this."""
    batch = fleet.engine.max_num_seqs
    uncached = (mean_prompt - mean_system) + fleet.engine.block_size / 2 + miss * mean_system
    per_request_s = uncached / calibration.prefill_tokens_per_s + mean_output * calibration.step_s(batch) / batch
    return fleet.engines / per_request_s
