"""kopf against KMock's Kubernetes emulator: InferenceFleets created, engine pods and their metrics stood in for, the
operator started against the emulator."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from kubernetes import client
from kubernetes.client import ApiClient

NS = "llm"
FLEETS = ("kvfleet.io", "v1alpha1", NS, "inferencefleets")
WINDOW_S = 12  # the fleet's scale-down stabilization window
PERIOD_S = 1.0  # the operator's --autoscale-interval


def eventually(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (client.ApiException, AssertionError, KeyError) as err:
            last = err
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {last}")


def create_fleet(api_client: ApiClient, name: str, spec: dict) -> None:
    body = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "1",
                         "generation": 1}, "spec": spec}
    client.CustomObjectsApi(api_client).create_namespaced_custom_object(*FLEETS, body)


class MetricsServer:
    """Stands in for engine pods' /metrics (the operator reads only that): load set by the test."""

    def __init__(self) -> None:
        self.kv, self.running, self.waiting = 0.0, 0, 0
        self.extra = ""  # more exposition lines (the capacity an engine measured of itself)
        self.raw: str | None = None  # served instead, whole (a vLLM pod's /metrics)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = (outer.raw if outer.raw is not None else
                        f"kvfleet_kv_cache_usage {outer.kv}\nkvfleet_num_requests_running {outer.running}\n"
                        f"kvfleet_num_requests_waiting {outer.waiting}\nkvfleet_max_num_seqs 16\n"
                        f"{outer.extra}").encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def engine_pod(fleet: str, name: str, port: int) -> dict:
    labels = {"app.kubernetes.io/name": "kvfleet-engine", "app.kubernetes.io/instance": fleet,
              "kvfleet.io/fleet": fleet}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels, "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": "engine", "image": "kvfleet/engine:cpu",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def replicas(api_client: ApiClient, name: str) -> int:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, name)["spec"]["replicas"]


def start_operator(kubeconfig: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "operator", "--metrics-port", "0", "--liveness", "",
         "--autoscale-interval", str(PERIOD_S)],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=open(log, "a"), stderr=subprocess.STDOUT)
