"""The simulated fleet, as the benchmark drives it: the model itself (engine pods calibrated from the engine
benchmark, the gateway queue, the 1 s loop) lives in the package, kvfleet/autoscale_replay/, where
`kvfleet bench autoscale` replays users' traces on it; simulate() here runs one of the benchmark's traces (every
request standard) and returns what the report needs."""

from __future__ import annotations

import math

from bench.autoscaler_sim.report import SimResult
from bench.autoscaler_sim.workloads import Trace
from kvfleet.autoscale_replay import fleet
from kvfleet.autoscale_replay.engine_model import EngineModel, Pod, Request
from kvfleet.autoscale_replay.fleet import Fleet, FleetView, Policy

DEFAULT_ENGINE = EngineModel()

__all__ = ["EngineModel", "Fleet", "FleetView", "Pod", "Policy", "Request", "simulate"]


def simulate(trace: Trace, policy: Policy, engine: EngineModel = DEFAULT_ENGINE,
             initial_replicas: int = 2, period_s: int = 15, tail_s: int = 1800) -> SimResult:
    """Run the trace, deciding every period_s; after it, run on with no arrivals (for at most tail_s) until every
    request has its first token. Replicas are counted over the trace only."""
    requests = [Request(k, at, prompt / engine.prefill_tokens_per_s, work)
                for k, (at, prompt, work) in enumerate(trace.arrivals)]
    run = fleet.simulate(requests, trace.duration_s, policy, engine, initial_replicas, period_s, tail_s)
    ttfts = [r.first_token - r.arrival if r.first_token is not None else math.inf for r in requests]
    return SimResult(ttfts, [trace.in_burst(r.arrival) for r in requests], run.replicas, run.pods, run.completed,
                     run.in_pods, run.gateway_queued)
