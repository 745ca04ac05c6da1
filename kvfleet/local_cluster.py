"""`kvfleet up --kubernetes`: the Kubernetes path on one machine, without a cluster.

An API emulator (KMock) stands in for the API server; the real operator (`kvfleet operator`) reconciles an
InferenceFleet there and autoscales it; a local kubelet (kvfleet/local_kubelet.py) turns the engine Deployment into
engine processes and Pods; the real gateway discovers those Pods through the API and queues in an embedded Redis.
The e2e scenarios (e2e/) run against this in CI, and against a kind cluster where Docker exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.kube_emulator import KubeEmulator
from kvfleet.local_fleet import port_is_free, run_until_signal, tail
from kvfleet.local_kubelet import LocalKubelet
from kvfleet.operator.fleet_spec import GROUP, KIND, PLURAL, VERSION, InvalidSpec, parse_fleet
from kvfleet.redis_server import RedisServer, free_port


@dataclass
class ClusterSpec:
    fleet: dict  # an InferenceFleet manifest (as `kubectl apply` would take it)
    namespace: str = "kvfleet"
    host: str = "127.0.0.1"
    port: int = 8080
    autoscale_interval_s: float = 15.0
    gateway_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 600.0


def default_fleet(name: str = "chat", model: str = "smollm2-135m-instruct", max_replicas: int = 2,
                  max_num_seqs: int = 16, kv_cache_memory: str = "256Mi") -> dict:
    """A small CPU fleet, as charts/kvfleet/examples' CPU fleet but sized for a laptop."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name},
            "spec": {"model": model, "image": "kvfleet/engine:cpu", "replicas": 1,
                     "engine": {"maxModelLen": 2048, "maxNumSeqs": max_num_seqs, "kvCacheMemory": kv_cache_memory},
                     "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": max_replicas}}}


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvfleet-cluster-"))
        self.emulator: KubeEmulator | None = None
        self.redis: RedisServer | None = None
        self.kubelet: LocalKubelet | None = None
        self.operator: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.kubeconfig = self.run_dir / "kubeconfig"

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def fleet_name(self) -> str:
        return self.spec.fleet["metadata"]["name"]

    def start(self) -> None:
        s = self.spec
        if not port_is_free(s.host, s.port):
            raise ValueError(f"port {s.port} on {s.host} is in use; choose another with --port")
        fleet = {**s.fleet, "metadata": {**s.fleet["metadata"], "namespace": s.namespace}}
        try:  # a bad manifest is reported here, before anything starts
            parse_fleet(self.fleet_name, s.namespace, fleet.get("spec") or {})
        except InvalidSpec as err:
            raise ValueError(f"the fleet manifest: {err}") from None
        from kvfleet.engine.model_files import resolve_model

        resolve_model(fleet["spec"]["model"])  # convert once, before engines race to
        self.emulator = KubeEmulator().start()
        self.emulator.write_kubeconfig(self.kubeconfig)
        self.redis = RedisServer().start()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", "1")}
        # Cluster-wide: with --namespace, kopf lists /api/v1/namespaces, which KMock 0.8 cannot serve.
        self.operator = self._spawn("operator", ["operator", "--redis-url", self.redis.url, "--autoscale-interval",
                                                 str(s.autoscale_interval_s), "--metrics-port", str(free_port()),
                                                 "--liveness", f"http://127.0.0.1:{free_port()}/healthz"], env)
        self.kubelet = LocalKubelet(self.emulator.api_client(), s.namespace, self.run_dir, env).start()
        self.apply_fleet(fleet)
        self.gateway = self._spawn("gateway", [
            "gateway", "--host", s.host, "--port", str(s.port), "--redis-url", self.redis.url,
            "--fleet", self.fleet_name, "--k8s-namespace", s.namespace,
            "--k8s-selector", f"kvfleet.io/fleet={self.fleet_name}", *s.gateway_args], env)
        self._wait(lambda: self._get(f"{self.url}/health"), "the gateway")
        if fleet["spec"].get("replicas", 1):  # the gateway is ready with no engine (it queues); wait for one
            self._wait(lambda: self._healthy_engines() > 0, "a ready engine pod behind the gateway")

    def apply_fleet(self, fleet: dict) -> None:
        """Create the fleet; the emulator assigns no uid or generation, so they are set here (owner references
        need the uid)."""
        from kubernetes import client

        body = {**fleet, "metadata": {**fleet["metadata"], "uid": str(uuid.uuid4()), "resourceVersion": "1",
                                      "generation": 1}}
        client.CustomObjectsApi(self.emulator.api_client()).create_namespaced_custom_object(
            GROUP, VERSION, fleet["metadata"]["namespace"], PLURAL, body)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.run_dir / f"{name}.log", "w") as log:
            return subprocess.Popen([sys.executable, "-m", "kvfleet.cli", *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _healthy_engines(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as response:
                return int(json.load(response).get("healthy", 0))
        except (OSError, ValueError):
            return 0

    @staticmethod
    def _get(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _wait(self, check, what: str) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            for name, proc in (("operator", self.operator), ("gateway", self.gateway)):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"the {name} exited with {proc.returncode}:\n"
                                       f"{tail(self.run_dir / f'{name}.log')}")
            if check():
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} after {self.spec.ready_timeout_s:.0f} s; logs in {self.run_dir}")

    def watch(self, stop_requested) -> int:
        while not stop_requested():
            for name, proc in (("operator", self.operator), ("gateway", self.gateway)):
                if proc.poll() is not None:
                    print(f"kvfleet up: the {name} exited with {proc.returncode}:\n"
                          f"{tail(self.run_dir / f'{name}.log')}", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self, timeout_s: float = 30.0) -> None:
        """The gateway first (no new requests), the operator (no new pods), the engines (they drain), the rest."""
        for proc in (self.gateway, self.operator):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.kubelet is not None:
            self.kubelet.stop(timeout_s)
        if self.redis is not None:
            self.redis.stop()
        if self.emulator is not None:
            self.emulator.stop()


def run(spec: ClusterSpec) -> int:
    def banner(cluster: LocalCluster) -> str:
        return (f"\nkvfleet (Kubernetes path, emulated API) is up: gateway {cluster.url}, fleet "
                f"{cluster.fleet_name!r} in namespace {spec.namespace}\n"
                f"  KUBECONFIG={cluster.kubeconfig}   (the operator, the gateway and the scenarios use it)\n"
                f"  KVFLEET_E2E_GATEWAY_URL={cluster.url} KVFLEET_E2E_NAMESPACE={spec.namespace} "
                f"KVFLEET_E2E_FLEET={cluster.fleet_name} KUBECONFIG={cluster.kubeconfig} python -m pytest e2e\n"
                f"  logs: {cluster.run_dir}\nCtrl-C stops everything.")

    return run_until_signal(LocalCluster(spec), banner)
