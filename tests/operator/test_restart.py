"""An operator restarted in the middle of a scale-down window scales down when the first one would have: the
autoscaler's windows live in the fleet's status, not in the operator's memory.

The real operator (`kvfleet operator`, a subprocess) against KMock's emulator, as in tests/operator/test_kmock.py;
the first operator is killed (SIGKILL, as a crash or a lost node) and a second one started in its place.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from tests.support.kmock import (
    FLEETS,
    NS,
    PERIOD_S,
    WINDOW_S,
    MetricsServer,
    create_fleet,
    engine_pod,
    eventually,
    replicas,
)

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def test_a_restart_during_the_scale_down_window_neither_hastens_nor_repeats_the_scale_down(cluster) -> None:
    api_client, operators, start = cluster
    metrics = MetricsServer()
    metrics.kv, metrics.running = 0.95, 10
    create_fleet(api_client, "steady", {
        "model": "smollm2-135m-instruct", "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetKVCacheUsage": 0.7,
                        "scaleDownStabilizationSeconds": WINDOW_S}})
    for i in range(2):
        client.CoreV1Api(api_client).create_namespaced_pod(NS, engine_pod("steady", f"steady-engine-{i}",
                                                                          metrics.port))
    start()
    eventually(lambda: replicas(api_client, "steady") == 3, timeout=30)  # ceil(2 × 0.95 / 0.7)
    time.sleep(3 * PERIOD_S)  # a few periods at the high load, so the window holds it

    metrics.kv, metrics.running = 0.05, 0
    low_since = time.monotonic()
    time.sleep(3 * PERIOD_S)
    operators[0].kill()  # mid-window: the first operator's memory is gone
    operators[0].wait(timeout=30)
    start()
    eventually(lambda: replicas(api_client, "steady") == 2, timeout=WINDOW_S + 20)
    waited = time.monotonic() - low_since
    # Without the restart it comes one window after the last high-load period (so within a period of WINDOW_S);
    # an operator that forgot the window would wait a whole window after its restart (~WINDOW_S + 5 s or more).
    assert WINDOW_S - 1.5 * PERIOD_S <= waited <= WINDOW_S + 3 * PERIOD_S, waited
    time.sleep(3 * PERIOD_S)
    fleet = client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, "steady")
    changes = [(e["from"], e["to"]) for e in fleet["status"]["scalingHistory"]]
    assert changes == [(2, 3), (3, 2)] and fleet["spec"]["replicas"] == 2  # scaled down once, not twice
    assert operators[1].poll() is None
