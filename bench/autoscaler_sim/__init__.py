"""Autoscaling policies on a simulated fleet: kvfleet's recommend() vs a KEDA queue-length policy vs HPA on
request rate, side by side on the same seeded bursty traces.

    python -m bench.autoscaler_sim --out bench/results          # ~20 s
    python -m bench.autoscaler_sim --replot bench/results/autoscaler_sim.json

It answers what a policy costs (replica-seconds) for the TTFT SLO it keeps (TTFT <= 2 s), without a cluster:
discrete time, 1 s steps, pure Python, no processes, and the operator's real recommend(). model.py runs the
fleet model of kvfleet/autoscale_replay/ (engine pods calibrated from the engine benchmark, the gateway queue, the
simulation loop; `kvfleet bench autoscale` replays users' traces on it); policies.py the compared autoscalers;
workloads.py the traces; report.py the figures, JSON, table and chart; __main__.py the CLI.

Traces: a day squeezed into 2 hours (1 to 4 requests/s), 20 idle minutes (longer than the 10 it takes the default
policy to reach zero), and 5 bursts of 5-10× for 30-120 s; figures pool several seeds because a burst's outcome
depends on how many pods a policy happens to hold when it hits. Every policy polls every 15 s with maxReplicas 64.
The queue-length policy counts the gateway's queue as waiting: vLLM production-stack's router has no queue and
would have sent those requests to the engines, where vllm:num_requests_waiting counts them.
"""

from bench.autoscaler_sim.model import EngineModel, Fleet, FleetView, Pod, Policy, Request, simulate
from bench.autoscaler_sim.policies import (
    HpaPolicy,
    KvfleetPolicy,
    policies,
    queue_length_hpa,
    request_rate_hpa,
    sweep_variants,
)
from bench.autoscaler_sim.report import SLO_TTFT_S, SimResult
from bench.autoscaler_sim.workloads import Trace, bursty_trace, constant_trace

__all__ = [
    "SLO_TTFT_S",
    "EngineModel",
    "Fleet",
    "FleetView",
    "HpaPolicy",
    "KvfleetPolicy",
    "Pod",
    "Policy",
    "Request",
    "SimResult",
    "Trace",
    "bursty_trace",
    "constant_trace",
    "policies",
    "queue_length_hpa",
    "request_rate_hpa",
    "simulate",
    "sweep_variants",
]
