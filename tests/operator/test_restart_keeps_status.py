"""An operator restart keeps what the fleet's status holds: the measured cold start (its samples, so pods the new
operator never saw still count), the autoscaler's windows and its decision, written every period.

The real operator (`kvfleet operator`, a subprocess) against KMock's emulator; the first one is killed (SIGKILL)."""

from __future__ import annotations

import datetime
import time

import pytest
from kubernetes import client

from tests.support.kmock import FLEETS, NS, PERIOD_S, MetricsServer, create_fleet, engine_pod, eventually

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def started_pod(name: str, port: int, start_s: float) -> dict:
    """An engine pod created a while ago that became Ready `start_s` seconds after its creation."""
    body = engine_pod("kept", name, port)
    created = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    body["metadata"]["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = (created + datetime.timedelta(seconds=start_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    body["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastTransitionTime": ready}]
    return body


def fleet_status(api_client) -> dict:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, "kept").get("status") or {}


def test_a_restart_keeps_the_cold_start_and_the_autoscalers_state_and_decides_the_same(cluster) -> None:
    api_client, operators, start = cluster
    core = client.CoreV1Api(api_client)
    metrics = MetricsServer()
    metrics.kv, metrics.running = 0.7, 4  # at the target: the fleet stays at 2
    create_fleet(api_client, "kept", {
        "model": "smollm2-135m-instruct", "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetKVCacheUsage": 0.7}})
    core.create_namespaced_pod(NS, started_pod("kept-engine-a", metrics.port, 30))
    core.create_namespaced_pod(NS, started_pod("kept-engine-b", metrics.port, 40))
    start()
    before = eventually(lambda: (s := fleet_status(api_client)).get("coldStartSeconds") == 40
                        and s.get("autoscaler", {}).get("lastDecision") and s, timeout=30)
    decision = before["autoscaler"]["lastDecision"]
    assert decision["desired"] == 2 and decision["inputs"]["coldStartSeconds"] == 40
    time.sleep(2 * PERIOD_S)  # a few periods of load in the burst detector's window

    operators[0].kill()
    operators[0].wait(timeout=30)
    killed_at = time.time()
    # Pod b goes away and a quicker one takes its place: a new operator that forgot b's start would say 30 s.
    core.delete_namespaced_pod("kept-engine-b", NS)
    core.create_namespaced_pod(NS, started_pod("kept-engine-c", metrics.port, 5))
    start()

    def decided_again():
        s = fleet_status(api_client)
        last = s["autoscaler"]["lastDecision"]
        return len(s["coldStart"]["samples"]) == 3 and last["time"] > decision["time"] and s
    after = eventually(decided_again, timeout=30)
    assert after["coldStartSeconds"] == 40  # 90th percentile of 30, 40 and 5: b's start was kept
    assert after["autoscaler"]["lastDecision"]["desired"] == decision["desired"]
    # The burst detector's window still holds the loads the first operator saw.
    assert after["autoscaler"]["loads"][0][0] == before["autoscaler"]["loads"][0][0] < killed_at
    time.sleep(3 * PERIOD_S)
    fleet = client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, "kept")
    assert fleet["spec"]["replicas"] == 2 and not fleet["status"].get("scalingHistory")
    assert operators[1].poll() is None
