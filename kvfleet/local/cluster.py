"""`kvfleet up --kubernetes`: the Kubernetes path on one machine, without a cluster.

An API emulator (KMock) stands in for the API server; the real operator (`kvfleet operator`) reconciles an
InferenceFleet there and autoscales it; a local kubelet (kvfleet/local/kubelet.py) turns the engine Deployment into
engine processes and Pods; the real gateway discovers those Pods through the API and queues in an embedded Redis.
The e2e scenarios (e2e/) run against this in CI, and against a kind cluster where Docker exists.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.fleet.engine_settings import DEFAULT_MODEL, LOCAL_CLUSTER
from kvfleet.fleet.ports import free_ports, port_is_free
from kvfleet.local.fleet import ENGINE_API_KEY_ENV, engine_env, run_until_signal, say
from kvfleet.local.kube_emulator import KubeEmulator
from kvfleet.local.kubelet import LocalKubelet
from kvfleet.local.redis_server import RedisServer
from kvfleet.local.supervisor import Child, Supervisor, http_ok, kvfleet_command
from kvfleet.local.vllm import ensure_vllm
from kvfleet.operator.fleet_spec import (
    DEFAULT_IMAGE,
    ENGINE_API_KEY_SECRET_KEY,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    InvalidSpec,
    parse_fleet,
)

ENGINE_AUTH_SECRET = "kvfleet-engine-auth"  # as the chart's <release>-kvfleet-engine-auth

# Loggers that write a line per API request or kubelet action: to files in the run directory, and to the
# terminal only with `kvfleet up --kubernetes --verbose` (their polling would flood it).
CHATTY_LOGS = {"aiohttp.access": "api-access.log", "kvfleet.local": "kubelet.log"}


class _ToTerminal(logging.Handler):
    """Hands the records at or above its level to the root logger's handlers (the terminal)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


def route_chatty_logs(run_dir: Path, verbose: bool) -> list[tuple[logging.Logger, logging.Handler]]:
    """Each chatty logger writes its file; the terminal gets its warnings, or everything when verbose."""
    added = []
    for name, filename in CHATTY_LOGS.items():
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        to_file = logging.FileHandler(run_dir / filename)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        to_terminal = _ToTerminal(logging.NOTSET if verbose else logging.WARNING)
        for handler in (to_file, to_terminal):
            logger.addHandler(handler)
            added.append((logger, handler))
    return added


def unroute_chatty_logs(added: list[tuple[logging.Logger, logging.Handler]]) -> None:
    for logger, handler in added:
        logger.removeHandler(handler)
        handler.close()
        logger.propagate = True


def require_kmock() -> None:
    """KMock is in the `local-k8s` extra (not a main dependency: it registers a pytest plugin that needs
    pytest-asyncio in every environment it is installed in)."""
    try:
        import kmock  # noqa: F401
    except ImportError:
        raise ValueError("kvfleet up --kubernetes needs KMock, the Kubernetes API emulator: pip install "
                         "'kvfleet[local-k8s]' (or, from a checkout, pip install -e '.[local-k8s]')") from None


@dataclass
class ClusterSpec:
    fleet: dict  # an InferenceFleet manifest (as `kubectl apply` would take it)
    namespace: str = "kvfleet"
    host: str = "127.0.0.1"
    port: int = 8080
    autoscale_interval_s: float = 15.0
    gateway_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 600.0
    vllm: str | None = None  # the `vllm` that runs a `runtime: vllm` fleet's pods (default: as kvfleet/local/vllm.py)
    verbose: bool = False  # the API emulator's access log and the local kubelet's lines in the terminal too


def default_fleet(name: str = "chat", model: str = DEFAULT_MODEL, max_replicas: int = 2,
                  max_num_seqs: int = LOCAL_CLUSTER.max_num_seqs,
                  kv_cache_memory: str | None = LOCAL_CLUSTER.kv_cache_memory, runtime: str = "kvfleet") -> dict:
    """A small CPU fleet, as charts/kvfleet/examples' CPU fleet but sized for a laptop (LOCAL_CLUSTER says why)."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name},
            "spec": {"model": model, "image": DEFAULT_IMAGE, "runtime": runtime, "replicas": 1,
                     "engine": {"maxModelLen": LOCAL_CLUSTER.max_model_len, "maxNumSeqs": max_num_seqs,
                                "kvCacheMemory": kv_cache_memory},
                     "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": max_replicas}}}


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvfleet-cluster-"))
        self.emulator: KubeEmulator | None = None
        self.redis: RedisServer | None = None
        self.kubelet: LocalKubelet | None = None
        self.procs = Supervisor(self.run_dir)  # the operator and the gateway; the kubelet runs the engines
        self.operator: Child | None = None
        self.gateway: Child | None = None
        self.kubeconfig = self.run_dir / "kubeconfig"
        self._log_handlers: list[tuple[logging.Logger, logging.Handler]] = []
        self.engine_api_key = secrets.token_urlsafe(32)  # a new one per run

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
        require_kmock()
        from kvfleet.engine.model_files import resolve_model

        resolve_model(fleet["spec"]["model"])  # convert once, before engines race to
        vllm = ensure_vllm(s.vllm, log=say) if fleet["spec"].get("runtime") == "vllm" else None
        self._log_handlers = route_chatty_logs(self.run_dir, s.verbose)
        self.emulator = KubeEmulator().start()
        self.emulator.write_kubeconfig(self.kubeconfig)
        self.redis = RedisServer().start()
        # The engines get the token only through the Secret (as on a cluster), never from this environment.
        env = {**{k: v for k, v in os.environ.items() if k != ENGINE_API_KEY_ENV}, "KUBECONFIG": str(self.kubeconfig),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.create_token_secret(s.namespace)
        # Cluster-wide: with --namespace, kopf lists /api/v1/namespaces, which KMock 0.8 cannot serve.
        metrics_port, liveness_port = free_ports(2)  # chosen together: never the same one twice
        self.operator = self._spawn("operator", ["operator", "--redis-url", self.redis.url, "--autoscale-interval",
                                                 str(s.autoscale_interval_s), "--metrics-port", str(metrics_port),
                                                 "--liveness", f"http://127.0.0.1:{liveness_port}/healthz",
                                                 "--engine-api-key-secret", ENGINE_AUTH_SECRET], env)
        self.kubelet = LocalKubelet(self.emulator.api_client(), s.namespace, self.run_dir, env, vllm=vllm).start()
        self.apply_fleet(fleet)
        self.gateway = self._spawn("gateway", [
            "gateway", "--host", s.host, "--port", str(s.port), "--redis-url", self.redis.url,
            "--fleet", self.fleet_name, "--k8s-namespace", s.namespace,
            "--k8s-selector", f"kvfleet.io/fleet={self.fleet_name}", *s.gateway_args],
            engine_env(env, self.engine_api_key))
        self._wait(lambda: http_ok(f"{self.url}/health"), "the gateway")
        if fleet["spec"].get("replicas", 1):  # the gateway is ready with no engine (it queues); wait for one
            self._wait(lambda: self._healthy_engines() > 0, "a ready engine pod behind the gateway")

    def create_token_secret(self, namespace: str) -> None:
        """The engines' token as the chart keeps it: a Secret the operator names in the engine pods' env."""
        from kubernetes import client

        token = base64.b64encode(self.engine_api_key.encode()).decode()
        client.CoreV1Api(self.emulator.api_client()).create_namespaced_secret(namespace=namespace, body={
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {ENGINE_API_KEY_SECRET_KEY: token},
            "metadata": {"name": ENGINE_AUTH_SECRET, "namespace": namespace}})

    def apply_fleet(self, fleet: dict) -> None:
        """Create the fleet; the emulator assigns no generation or resourceVersion, so they are set here (and the
        uid, which owner references need, though the emulator now gives every created object one)."""
        from kubernetes import client

        body = {**fleet, "metadata": {**fleet["metadata"], "uid": str(uuid.uuid4()), "resourceVersion": "1",
                                      "generation": 1}}
        client.CustomObjectsApi(self.emulator.api_client()).create_namespaced_custom_object(
            GROUP, VERSION, fleet["metadata"]["namespace"], PLURAL, body)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        return self.procs.start(name, kvfleet_command(*args), env=env)

    def _healthy_engines(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as response:
                return int(json.load(response).get("healthy", 0))
        except (OSError, ValueError):
            return 0

    def _wait(self, check, what: str) -> None:
        """Until check() holds; an error with the log's end if the operator or the gateway exits first."""
        self.procs.wait_until(check, what, self.spec.ready_timeout_s, poll_s=0.2)

    def watch(self, stop_requested) -> int:
        while not stop_requested():
            for child in (self.operator, self.gateway):
                if child.poll() is not None:
                    print(f"kvfleet up: the {child.name} exited with {child.returncode}:\n{child.tail()}",
                          file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self, timeout_s: float = 30.0) -> None:
        """The gateway first (no new requests), the operator (no new pods), the engines (they drain), the rest."""
        self.procs.stop(timeout_s)  # the gateway, then the operator: the reverse of their start
        if self.kubelet is not None:
            self.kubelet.stop(timeout_s)
        if self.redis is not None:
            self.redis.stop()
        if self.emulator is not None:
            self.emulator.stop()
        unroute_chatty_logs(self._log_handlers)
        self._log_handlers = []


def run(spec: ClusterSpec) -> int:
    def banner(cluster: LocalCluster) -> str:
        return (f"\nkvfleet (Kubernetes path, emulated API) is up: gateway {cluster.url}, fleet "
                f"{cluster.fleet_name!r} in namespace {spec.namespace}\n"
                f"  KUBECONFIG={cluster.kubeconfig}   (the operator, the gateway and the scenarios use it)\n"
                f"  KVFLEET_E2E_GATEWAY_URL={cluster.url} KVFLEET_E2E_NAMESPACE={spec.namespace} "
                f"KVFLEET_E2E_FLEET={cluster.fleet_name} KUBECONFIG={cluster.kubeconfig} python -m pytest e2e\n"
                f"  logs: {cluster.run_dir} (the API's access log and the local kubelet's in api-access.log and "
                f"kubelet.log; --verbose prints them here)\nCtrl-C stops everything.")

    return run_until_signal(LocalCluster(spec), banner)
