"""Prefix-aware routing at fleet scale, simulated: 64 engines, 8 gateway replicas, 1,000 tenants, every policy.

    python -m bench.prefix_sim --quick      # 8 engines, 2 replicas, 100 tenants: under a minute
    python -m bench.prefix_sim              # 64 x 8 x 1000 at loads 0.5, 0.8, 0.95 of capacity

A discrete-event model, pure Python: engines batch continuously by a step-time model calibrated from the real engine
(calibrate.py) and decide prefix hits and evictions with the engine's real BlockManager, whose KV events feed each
gateway replica's real KVIndex after a delay; replicas route with the gateway's real strategies and prefix layers
(gateway/routing/pick.py, gateway/prefix/worth.py) over their own scraped, staggered view. workload.py is the
traffic; engine.py an engine; gateway.py the replicas and the oracle; model.py the loop; report.py the figures;
__main__.py the CLI.
"""

from bench.prefix_sim.calibrate import Calibration
from bench.prefix_sim.engine import EngineShape, SimEngine
from bench.prefix_sim.gateway import POLICIES, Oracle, Replica
from bench.prefix_sim.model import FleetShape, Run, fleet_capacity_rps, simulate
from bench.prefix_sim.report import summarize
from bench.prefix_sim.workload import Arrival, WorkloadShape, poisson_trace

__all__ = ["POLICIES", "Arrival", "Calibration", "EngineShape", "FleetShape", "Oracle", "Replica", "Run",
           "SimEngine", "WorkloadShape", "fleet_capacity_rps", "poisson_trace", "simulate", "summarize"]
