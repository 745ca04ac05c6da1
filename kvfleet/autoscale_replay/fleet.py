"""The simulated fleet and its loop: engine pods behind the gateway, and simulate(), which runs requests second by
second under an autoscaling policy.

Pods are ready after a cold start and drain when scaled down (draining and starting pods count in replica-seconds).
With a warm pool of N, N more pods are kept asleep (loaded, the KV cache released: engine sleep mode): a scale-up
wakes them first, ready after wake_s, and new pods refill the pool; a drained pod goes to sleep while the pool is
short. Asleep pods are counted apart (Run.asleep).

The gateway routes to the least-loaded ready pod, and a critical request where it starts soonest (the prefill of the
critical requests ahead of it there and of the lower-class prompts pending there); with a critical lane, while
critical requests come, the first ready pod takes no lower-class request; while every pod is saturated (waiting >= 5
or KV >= 0.8) or none is ready it queues requests, ordered as its fleet queue orders them (class first, with aging),
and sheds sheddable arrivals (429), as its admission verdict does; with caps, a class whose queue is full is shed
too. TTFT = gateway wait + pod wait + prefill.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.autoscale_replay.batch import BatchJob, BatchRunner
from kvfleet.autoscale_replay.engine_model import EngineModel, Pod, Request
from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import ClassWindow
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.routing.pick import LANE_HOLD_S, LANE_MIN_ENGINES
from kvfleet.operator.autoscaler import PodLoad
from kvfleet.operator.batch_demand import BatchBacklog
from kvfleet.operator.fleet_fields import autoscaling_default
from kvfleet.operator.planner import demand_windows

# The replay's kvfleet policy keeps the default stable window (replay.py), so its demand windows are the default's.
DEMAND_WINDOW_S, RECENT_WINDOW_S = demand_windows(autoscaling_default("stable_window_s"))
AGING_S = GatewayConfig.aging_ms / 1000  # the gateway's default: a class waits at most this long behind the one above


@dataclass(frozen=True)
class FleetView:
    """What a policy sees at a decision: the Deployment's replicas, its ready pods' metrics, the gateway queue."""

    time: float
    replicas: int
    pods: tuple[PodLoad, ...]
    gateway_queued: int
    arrivals_per_s: float  # over the last minute, as Prometheus rate(...[1m]) would give it
    concurrency: tuple[int, ...] = ()  # requests in the system (pods and queue) at each of the last 60 seconds
    # What the gateways count per class over the last minute (kvfleet/fleet/slo.py). Here a request's output tokens
    # are counted when it arrives (the gateway counts them with its answer; the planner uses their mean).
    classes: Mapping[Priority, ClassWindow] = field(default_factory=dict)
    cold_start_s: float | None = None  # as the operator measures it
    recent_classes: Mapping[Priority, ClassWindow] = field(default_factory=dict)  # as classes, the last 15 s
    batch: tuple[BatchBacklog, ...] = ()  # the Batch API's unfinished jobs, as the gateways report them
    warm: int = 0  # pods asleep in the warm pool, ready to wake
    wake_s: float | None = None


class Policy(Protocol):
    """An autoscaler as the simulation drives it: the replicas it wants, given what it sees."""

    def desired(self, view: FleetView) -> int: ...


@dataclass
class Run:
    """What a simulation produced: every request as it ended, and the replicas at each second of the trace."""

    requests: list[Request]
    replicas: list[int]  # the Deployment's replicas at each second of the trace
    pods: list[int]  # every pod that costs: starting, ready, draining
    in_pods: int  # running or waiting in a pod when the simulation stopped
    gateway_queued: int
    batch: dict | None = None  # the batch jobs' report (BatchRunner.report), when the trace has jobs
    asleep: list[int] = field(default_factory=list)  # of `pods`, those asleep in the warm pool, at each second

    @property
    def completed(self) -> int:
        return sum(1 for r in self.requests if r.done)


class Fleet:
    """Engine pods behind a gateway that routes to the least-loaded ready pod and queues while all are saturated."""

    def __init__(self, engine: EngineModel, replicas: int, saturation_waiting: int = 5,
                 saturation_kv: float = 0.8, queue_caps: dict[Priority, int] | None = None,
                 critical_first: bool = True, batch: BatchRunner | None = None, warm_pool: int = 0,
                 wake_s: float = 5.0, critical_lane: bool = False) -> None:
        self.engine, self.saturation_waiting, self.saturation_kv = engine, saturation_waiting, saturation_kv
        self.critical_lane = critical_lane
        self.warm_pool, self.wake_s = warm_pool, wake_s
        self.batch = batch
        self.critical_first = critical_first
        self.queue_caps = queue_caps
        self.pods = [Pod(engine, 0.0) for _ in range(replicas)]
        for _ in range(warm_pool):
            self._start_asleep(0.0)
        self.queue: list[tuple[float, int, Request]] = []  # heap by (the gateway's score, arrival order)
        self.queued_by_class = dict.fromkeys(Priority, 0)
        self.arrivals_per_second: list[int] = []
        self.concurrency: list[int] = []
        # per second and class: [arrivals, prompt tokens, output tokens, shed]
        self.class_seconds: list[dict[Priority, list[int]]] = []

    @property
    def replicas(self) -> int:
        """The serving replicas the autoscaler sets: not draining, not in the warm pool."""
        return sum(1 for p in self.pods if not p.draining and not p.asleep)

    @property
    def asleep(self) -> int:
        """The warm pool as it stands: asleep, or starting to be (a new pod goes to sleep once loaded)."""
        return sum(1 for p in self.pods if p.asleep)

    def ready_pods(self, now: float) -> list[Pod]:
        return [p for p in self.pods if not p.draining and not p.asleep and p.ready_at <= now]

    def view(self, now: float) -> FleetView:
        recent = self.arrivals_per_second[-60:]
        warm = sum(1 for p in self.pods if p.asleep and p.ready_at <= now)
        return FleetView(now, self.replicas, tuple(p.metrics(now) for p in self.ready_pods(now)), len(self.queue),
                         sum(recent) / max(1, len(recent)), tuple(self.concurrency[-60:]), self.class_windows(),
                         float(self.engine.cold_start_s), self.class_windows(RECENT_WINDOW_S),
                         self.batch.backlog(now) if self.batch else (), warm,
                         float(self.wake_s) if self.warm_pool else None)

    def class_windows(self, window_s: float = DEMAND_WINDOW_S) -> dict[Priority, ClassWindow]:
        recent = self.class_seconds[-int(window_s):]
        sums = {p: [sum(s[p][k] for s in recent) for k in range(4)] for p in Priority}
        return {p: ClassWindow(float(max(1, len(recent))), a, pt, a, ot, shed, queued=self.queued_by_class[p])
                for p, (a, pt, ot, shed) in sums.items()}

    def scale_to(self, desired: int, now: float) -> None:
        """More pods: the warm pool's wake first (loaded ones after wake_s, those still loading when loaded), then
        new pods start cold; the pool is refilled with new pods. Removal takes pods not yet ready first, then the
        least-loaded, which drain."""
        live = [p for p in self.pods if not p.draining and not p.asleep]
        needed = desired - len(live)
        for pod in sorted((p for p in self.pods if p.asleep), key=lambda p: p.ready_at)[:max(0, needed)]:
            pod.asleep = False
            if pod.ready_at <= now:  # loaded: serving after the wake (else after its load)
                pod.ready_at = now + self.wake_s
            needed -= 1
        for _ in range(needed):
            self.pods.append(Pod(self.engine, now + self.engine.cold_start_s))
        for _ in range(self.warm_pool - self.asleep):
            self._start_asleep(now + self.engine.cold_start_s)
        if desired < len(live):
            for pod in sorted(live, key=lambda p: (p.ready_at <= now, p.load, -p.ready_at))[:len(live) - desired]:
                if pod.ready_at > now:
                    self.pods.remove(pod)
                else:
                    pod.draining = True

    def _start_asleep(self, ready_at: float) -> None:
        """A new pod for the warm pool: it sleeps once loaded."""
        pod = Pod(self.engine, ready_at)
        pod.asleep = True
        self.pods.append(pod)

    def step(self, now: float, arrivals: list[Request]) -> None:
        """One second: route the gateway's queue (in its order) and the new arrivals, then serve."""
        self.arrivals_per_second.append(len(arrivals))
        counts = {p: [0, 0, 0, 0] for p in Priority}
        for r in arrivals:
            c = counts[r.priority]
            c[0] += 1
            c[1] += r.prompt_tokens
            c[2] += r.output_tokens
        self.class_seconds.append(counts)
        scraped = [(p, p.metrics(now)) for p in self.ready_pods(now)]
        sent: list[list[tuple[float, Request]]] = [[] for _ in scraped]
        lane = self._lane(len(scraped))
        heap = [(m.running + m.waiting, k) for k, (_, m) in enumerate(scraped) if k not in lane]
        heapq.heapify(heap)
        pending = [(now, r) for _, _, r in sorted(self.queue)] + [(r.arrival, r) for r in arrivals]
        self.queue.clear()
        self.queued_by_class = dict.fromkeys(Priority, 0)
        critical = [self._critical_outstanding(pod, now) for pod, _ in scraped]
        ahead = [self._critical_start_s(pod, now) for pod, _ in scraped]
        lower = [self._lower_class_s(pod, now) for pod, _ in scraped]
        for at, request in pending:
            if self.critical_first and request.priority is Priority.CRITICAL and critical:
                # among the pods with room for it (fewer critical requests not begun than the saturation queue),
                # where it would start soonest: the critical prompts there and the lower-class prefill pending
                # there (routing.pick.soonest_critical_start)
                room = [i for i in range(len(critical)) if critical[i] < self.saturation_waiting]
                if room:
                    k = min(room, key=lambda i: (ahead[i] + lower[i], critical[i],
                                                 scraped[i][1].running + len(sent[i])))
                    sent[k].append((at, request))
                    critical[k] += 1
                    ahead[k] += request.prefill_s
                    continue
            while heap and self._saturated(*scraped[heap[0][1]], len(sent[heap[0][1]]), now):
                heapq.heappop(heap)  # saturated pods stay so until the next scrape
            if not heap:  # and once one request waits, every later one does: nobody overtakes the queue
                self._hold(request)
                continue
            load, k = heapq.heappop(heap)
            sent[k].append((at, request))
            lower[k] += request.prefill_s
            heapq.heappush(heap, (load + 1, k))
        if self.batch is not None:
            self._send_batch(now, scraped, sent)
        by_pod = {id(p): s for (p, _), s in zip(scraped, sent, strict=True)}
        for pod in self.pods:
            if pod.ready_at <= now:
                pod.advance(now, now + 1, by_pod.get(id(pod), []))
        for pod in self.pods:
            if pod.draining and pod.load == 0 and self.asleep < self.warm_pool:
                pod.draining, pod.asleep = False, True  # drained: it sleeps in the pool rather than going
        self.pods = [p for p in self.pods if not (p.draining and p.load == 0)]
        self.concurrency.append(sum(p.load for p in self.pods) + len(self.queue))

    def _lane(self, ready: int) -> set[int]:
        """The critical lane among the ready pods (routing.pick.critical_lane): the first, while a critical request
        came in the last LANE_HOLD_S and LANE_MIN_ENGINES are ready; the gateway takes the first by URL, the replay
        the oldest."""
        recent = self.class_seconds[-int(LANE_HOLD_S):]
        if self.critical_lane and ready >= LANE_MIN_ENGINES and any(s[Priority.CRITICAL][0] for s in recent):
            return {0}
        return set()

    def _send_batch(self, now: float, scraped: list[tuple[Pod, PodLoad]], sent: list[list[tuple[float, Request]]]
                    ) -> None:
        """The batch runner's turn, after the interactive arrivals: what it may send, sent at the second's start."""
        assert self.batch is not None
        self.batch.settle(now)
        lane = self._lane(len(scraped))
        pods = [(pod, m, len(sent[k]), k in lane or self._saturated(pod, m, len(sent[k]), now))
                for k, (pod, m) in enumerate(scraped)]
        for k, requests in self.batch.dispatch(now, pods, len(self.queue)).items():
            sent[k] = sorted(sent[k] + [(now, r) for r in requests], key=lambda x: x[0])

    @staticmethod
    def _critical_outstanding(pod: Pod, now: float) -> int:
        """Critical requests a pod has not yet begun to prefill: all a new critical request would wait behind."""
        waiting = sum(1 for _, _, r in pod.waiting if r.priority is Priority.CRITICAL)
        return waiting + sum(1 for start, _, r in pod.prefills if start > now and r.priority is Priority.CRITICAL)

    @staticmethod
    def _critical_start_s(pod: Pod, now: float) -> float:
        """What the gateway counts ahead of a critical request on a pod (EndpointSnapshot.critical_pending_tokens):
        the prefill of every critical request it sent there whose first token has not come, in seconds."""
        pending = {id(r): r for _, _, r in pod.prefills if r.priority is Priority.CRITICAL
                   and (r.first_token is None or r.first_token > now)}
        pending.update((id(r), r) for _, _, r in pod.waiting if r.priority is Priority.CRITICAL)
        return sum(r.prefill_s for r in pending.values())

    @staticmethod
    def _lower_class_s(pod: Pod, now: float) -> float:
        """What the gateway counts of lower classes on a pod (routing.pick.lower_class_tokens), in seconds: the
        prefill of its prompts below critical still to compute."""
        return sum(min(seconds, start + seconds - now) for start, seconds, r in pod.prefills
                   if r.priority is not Priority.CRITICAL and start + seconds > now)

    def _hold(self, request: Request) -> None:
        """Queue the request, or shed it: sheddable traffic never waits, and a full class takes no more."""
        cap = self.queue_caps.get(request.priority) if self.queue_caps else None
        full = cap is not None and self.queued_by_class[request.priority] >= cap
        if request.priority is Priority.SHEDDABLE or full:
            request.shed = True
            if self.class_seconds:
                self.class_seconds[-1][request.priority][3] += 1
            return
        self.queued_by_class[request.priority] += 1
        heapq.heappush(self.queue, (request.arrival + request.priority.rank * AGING_S, request.rid, request))

    def _saturated(self, pod: Pod, scraped: PodLoad, sent: int, now: float) -> bool:
        """The gateway's view: the last scrape, plus what it sent since beyond the prompts the pod can begin."""
        starts = (now + 1 - max(now, pod.prefill_free_at)) / self.engine.mean_prefill_s
        room = self.engine.max_num_seqs - len(pod.running)
        started = max(0, min(sent, room, int(starts)))
        waiting, running = scraped.waiting + sent - started, scraped.running + started
        return waiting >= self.saturation_waiting or running * self.engine.kv_per_request >= self.saturation_kv


def simulate(requests: list[Request], duration_s: int, policy: Policy, engine: EngineModel,
             initial_replicas: int = 2, period_s: int = 15, tail_s: int = 1800,
             queue_caps: dict[Priority, int] | None = None, jobs: tuple[BatchJob, ...] = (), warm_pool: int = 0,
             wake_s: float = 5.0, critical_lane: bool = False) -> Run:
    """Run the requests (sorted by arrival) and the batch jobs, deciding every period_s; after the trace, run on
    with no arrivals (for at most tail_s) until every request has its first token. Replicas are counted over the
    trace only."""
    runner = BatchRunner(jobs, engine) if jobs else None
    fleet = Fleet(engine, initial_replicas, queue_caps=queue_caps, batch=runner, warm_pool=warm_pool, wake_s=wake_s,
                  critical_lane=critical_lane)
    replicas, pods, asleep, next_arrival, now = [], [], [], 0, 0
    while now < duration_s or (now < duration_s + tail_s and _unstarted(fleet)):
        if now % period_s == 0:
            fleet.scale_to(policy.desired(fleet.view(now)), now)
        if now < duration_s:
            replicas.append(fleet.replicas)
            pods.append(len(fleet.pods))
            asleep.append(fleet.asleep)
        first = next_arrival
        while next_arrival < len(requests) and requests[next_arrival].arrival < now + 1:
            next_arrival += 1
        fleet.step(now, requests[first:next_arrival])
        now += 1
    if runner is not None:
        runner.settle(now)
    return Run(requests, replicas, pods, sum(p.load for p in fleet.pods), len(fleet.queue),
               runner.report() if runner else None, asleep)


def _unstarted(fleet: Fleet) -> bool:
    return bool(fleet.queue) or any(p.waiting for p in fleet.pods)
