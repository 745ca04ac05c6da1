"""The warm pool end to end on the local Kubernetes path (issue 40, item 2): the same fleet (SmolLM2-135M engines,
the operator, the gateway, on KMock's emulated API and the local kubelet) with and without
`spec.autoscaling.warmPool: {replicas: 1}`; a burst of requests through the gateway makes the autoscaler want a
second replica, and the script measures from that decision (spec.replicas 1 -> 2) to the second engine serving
behind the gateway (its /ready counts it healthy). Without the pool that is a new pod's cold start; with it, waking
the pod that slept.

    python -m bench.warm_pool_local --json docs/benchmarks/warm_pool_local.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
from kubernetes import client

from kvfleet.fleet.ports import free_port
from kvfleet.local.cluster import ClusterSpec, LocalCluster, default_fleet

BURST = 40  # concurrent requests: more than one engine's batch (16) and its queue


def fleet_object(cluster: LocalCluster) -> dict:
    return client.CustomObjectsApi(cluster.emulator.api_client()).get_namespaced_custom_object(
        "kvfleet.io", "v1alpha1", "kvfleet", "inferencefleets", "chat")


def healthy(cluster: LocalCluster) -> int:
    try:
        return int(httpx.get(f"{cluster.url}/ready", timeout=2).json().get("healthy", 0))
    except (httpx.HTTPError, ValueError):
        return 0


def wait(check, what: str, timeout_s: float = 300.0, step_s: float = 0.05) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic()
        time.sleep(step_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def arm(warm: int) -> dict:
    fleet = default_fleet("chat", max_replicas=2)
    if warm:
        fleet["spec"]["autoscaling"]["warmPool"] = {"replicas": warm, "wakeSeconds": 2}
    cluster = LocalCluster(ClusterSpec(fleet, port=free_port(), autoscale_interval_s=2))
    stop = threading.Event()
    try:
        cluster.start()
        if warm:
            wait(lambda: (fleet_object(cluster).get("status") or {}).get("warmPool", {}).get("asleep") == warm,
                 "pod asleep in the warm pool")
        time.sleep(6)  # a few quiet periods: the planner's demand history

        def client_loop() -> None:
            body = {"model": "smollm2-135m-instruct", "prompt": "Tell me a long story about a lighthouse.",
                    "max_tokens": 256, "ignore_eos": True}
            while not stop.is_set():
                try:
                    httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=300)
                except httpx.HTTPError:
                    time.sleep(0.2)

        threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(BURST)]
        started = time.monotonic()
        for t in threads:
            t.start()
        decided = wait(lambda: fleet_object(cluster)["spec"].get("replicas", 1) >= 2, "scale-up decision")
        serving = wait(lambda: healthy(cluster) >= 2, "second engine serving")
        status = fleet_object(cluster).get("status") or {}
        return {"warm_pool": warm, "burst_to_decision_s": round(decided - started, 2),
                "decision_to_serving_s": round(serving - decided, 2), "warm_pool_status": status.get("warmPool"),
                "cold_start_s": status.get("coldStartSeconds")}
    finally:
        stop.set()
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    results = [arm(0), arm(1)]
    for r in results:
        print(json.dumps(r), flush=True)
    ratio = results[1]["decision_to_serving_s"] / results[0]["decision_to_serving_s"]
    print(f"decision to serving: {results[1]['decision_to_serving_s']} s with the warm pool, "
          f"{results[0]['decision_to_serving_s']} s without ({ratio:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"command": "python -m bench.warm_pool_local " + " ".join(argv or sys.argv[1:]),
                                         "arms": results, "ratio": round(ratio, 3)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
