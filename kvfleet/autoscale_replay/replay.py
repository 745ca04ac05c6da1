"""One replay: the same trace through the same simulated fleet (engine model, cold start, gateway) under each
named policy, scored against the same SLOs. Every policy but the oracle decides every 15 s (KPA every 2 s, its
tick) from what it observes; all start from 2 ready pods."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvfleet.autoscale_replay.engine_model import MEAN_OUTPUT_TOKENS, EngineModel, Request
from kvfleet.autoscale_replay.fleet import Policy, Run, simulate
from kvfleet.autoscale_replay.kpa import TICK_S, KpaPolicy
from kvfleet.autoscale_replay.oracle import plan
from kvfleet.autoscale_replay.policies import KvfleetPolicy, hpa_kv, keda_queue
from kvfleet.autoscale_replay.slo import Slo, score
from kvfleet.autoscale_replay.trace import Trace
from kvfleet.gateway.config import DEFAULT_CAPS
from kvfleet.operator.autoscaler import AutoscalingPolicy

POLICY_NAMES = ("kvfleet", "keda-queue", "hpa-kv", "kpa", "oracle")
PERIOD_S = 15
INITIAL_REPLICAS = 2
TAIL_S = 1800  # after the trace, run on until every request has its first token, for at most this long


@dataclass(frozen=True)
class Settings:
    engine: EngineModel = field(default_factory=EngineModel)
    slo: Slo = field(default_factory=Slo)
    max_replicas: int = 64
    # kvfleet's warm pool (spec.autoscaling.warmPool): pods kept asleep, serving again wake_s after a scale-up; the
    # other policies have none (KEDA's and HPA's recipes know no sleeping pods; the oracle plans cold pods)
    warm_pool: int = 0
    wake_s: float = 5.0
    # kvfleet's critical lane (the gateway's --critical-lane and spec.autoscaling.criticalLane): one pod kept free of
    # lower-class requests while critical ones come, and planned for
    critical_lane: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_replicas <= 1000:
            raise ValueError(f"--max-replicas must be from 1 to 1000, not {self.max_replicas}")
        if not 0 <= self.warm_pool <= 100:
            raise ValueError(f"--warm-pool must be from 0 to 100, not {self.warm_pool}")
        if not 0 <= self.wake_s <= 600:
            raise ValueError(f"--wake-seconds must be from 0 to 600, not {self.wake_s}")

    def public(self) -> dict:
        return {"engine": asdict(self.engine), "max_replicas": self.max_replicas,
                "slo_ttft_s": {p.value: v for p, v in self.slo.ttft_s.items()},
                "attainment_target": {p.value: v for p, v in self.slo.attainment.items()},
                "decision_period_s": PERIOD_S, "initial_replicas": INITIAL_REPLICAS,
                "kvfleet_warm_pool": self.warm_pool, "wake_s": self.wake_s, "kvfleet_critical_lane": self.critical_lane}


def reactive(name: str, settings: Settings) -> tuple[Callable[[], Policy], int]:
    """A fresh policy of that name and how often it decides."""
    n, engine = settings.max_replicas, settings.engine
    if name == "kvfleet":
        return lambda: KvfleetPolicy(AutoscalingPolicy(min_replicas=1, max_replicas=n,
                                                       critical_lane=settings.critical_lane)), PERIOD_S
    if name == "keda-queue":
        return lambda: keda_queue(n), PERIOD_S
    if name == "hpa-kv":
        return lambda: hpa_kv(n), PERIOD_S
    if name == "kpa":
        return lambda: KpaPolicy(target=engine.max_num_seqs, max_replicas=n), TICK_S
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def requests_of(trace: Trace, engine: EngineModel) -> list[Request]:
    """Fresh simulated requests for the trace's rows (a simulation marks them as it serves them)."""
    return [Request(k, r.t, r.prompt_tokens / engine.prefill_tokens_per_s, r.output_tokens / MEAN_OUTPUT_TOKENS,
                    r.priority, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens)
            for k, r in enumerate(trace.rows)]


def run_policy(trace: Trace, name: str, settings: Settings) -> dict:
    """One policy's score (the documented keys) with the settings it ran under and its wall time."""
    started = time.monotonic()
    engine = settings.engine

    warm = settings.warm_pool if name == "kvfleet" else 0
    lane = settings.critical_lane and name == "kvfleet"

    def sim(policy: Policy, period_s: int) -> Run:
        return simulate(requests_of(trace, engine), trace.duration_s, policy, engine, INITIAL_REPLICAS, period_s,
                        TAIL_S, DEFAULT_CAPS, trace.jobs, warm, settings.wake_s, lane)

    extra: dict = {}
    period = 1
    if name == "oracle":
        found = plan(requests_of(trace, engine), trace.duration_s, engine, settings.slo, settings.max_replicas,
                     lambda schedule: sim(schedule, 1))
        run = found.run
        extra = {"meets_targets": found.meets_targets, "simulations": found.simulations,
                 "work_bound_replica_seconds": round(found.work_bound_replica_seconds, 1)}
    else:
        make, period = reactive(name, settings)
        run = sim(make(), period)
    return score(run, settings.slo) | extra | {"max_replicas_used": max(run.replicas, default=0),
                                                "settings": settings.public() | {"decision_period_s": period},
                                                "wall_s": round(time.monotonic() - started, 2)}


def replay(trace: Trace, names: list[str], settings: Settings) -> dict[str, dict]:
    """Every named policy on the trace, in the order given (each name once)."""
    for name in names:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return {name: run_policy(trace, name, settings) for name in dict.fromkeys(names)}
