"""`kvfleet up --kubernetes`: the operator and the gateway against an emulated API, engines as local processes.

The e2e scenarios (e2e/) drive a whole local cluster; here: the local kubelet's decisions, a bad manifest
refused before anything starts, an install that lacks KMock told what to install, and one real cluster (started
once for the module: it takes a minute or two) that serves, keeps its engines behind their token, answers
`kubectl get ifleet` and `kubectl get pods` as a real cluster does, keeps the API's access log out of the terminal,
and, once stopped, leaves no process and no listener behind.
"""

from __future__ import annotations

import ast
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import httpx
import psutil
import pytest
from kubernetes import client

from kvfleet.local.cluster import ClusterSpec, LocalCluster, default_fleet, route_chatty_logs, unroute_chatty_logs
from kvfleet.local.kube_tables import human_age
from kvfleet.local.kubelet import PodProcess, Stopping, local_command, pods_to_stop, termination
from tests.conftest import free_port
from tests.support.lora_adapters import make_adapter
from tests.support.paths import ROOT

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def pod(name: str, ready: bool) -> PodProcess:
    return PodProcess(name, "chat-engine", None, 0, None, ready=ready)  # type: ignore[arg-type]


def test_a_replicaset_stops_not_ready_pods_first_then_the_newest() -> None:
    pods = [pod("a", True), pod("b", False), pod("c", True), pod("d", True)]
    assert [p.name for p in pods_to_stop(pods, 2)] == ["b", "d"]
    assert pods_to_stop(pods, 4) == [] and pods_to_stop(pods, 9) == []
    assert [p.name for p in pods_to_stop(pods, 0)] == ["b", "d", "c", "a"]


def test_a_deleted_pod_sleeps_its_prestop_then_gets_sigterm_then_sigkill_at_its_grace() -> None:
    """As a kubelet: the gateway, watching the Pods, stops routing to a deleted one during its preStop sleep, so its
    engine gets SIGTERM only once nothing new comes; SIGKILL when terminationGracePeriodSeconds (from the deletion,
    the sleep included) run out."""
    container = {"lifecycle": {"preStop": {"sleep": {"seconds": 5}}}}
    assert termination(container, {"terminationGracePeriodSeconds": 45}) == (5.0, 45.0)
    assert termination({}, {}) == (0.0, 30.0)  # no hook: SIGTERM at once; Kubernetes' default grace
    leaving = Stopping(PodProcess("a", "chat-engine", None, 0, None, prestop_s=5, grace_s=45), since=100.0)  # type: ignore[arg-type]
    assert [leaving.due(t) for t in (100.0, 104.9)] == [None, None]
    assert leaving.due(105.0) == signal.SIGTERM
    assert leaving.due(120.0) is None and leaving.due(145.0) == signal.SIGKILL
    assert leaving.due(145.5) is None  # each signal once: a killed process may take a sync to be reaped
    short = Stopping(PodProcess("b", "chat-engine", None, 0, None, prestop_s=60, grace_s=10), since=0.0)  # type: ignore[arg-type]
    assert short.due(9.9) is None and short.due(10.0) == signal.SIGKILL  # the grace bounds the hook too


def test_the_container_command_runs_here_on_loopback() -> None:
    container = {"command": ["kvfleet"], "args": ["engine", "--model", "m", "--host", "0.0.0.0", "--port", "8000",
                                                  "--max-num-seqs", "8"]}
    assert local_command(container, 4321) == [sys.executable, "-m", "kvfleet.cli", "engine", "--model", "m",
                                              "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", "4321"]


@pytest.mark.parametrize(("change", "message"), [
    ({"model": ""}, "spec.model is required"),
    ({"engine": {"kvCacheMemory": "lots"}}, "kvCacheMemory"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas"),
])
def test_a_bad_fleet_manifest_is_refused_before_anything_starts(change: dict, message: str) -> None:
    manifest = default_fleet()
    manifest["spec"] = {**manifest["spec"], **change}
    cluster = LocalCluster(ClusterSpec(manifest, port=free_port()))
    with pytest.raises(ValueError, match=message):
        cluster.start()
    assert cluster.emulator is None and cluster.operator is None




def test_without_kmock_the_install_to_run_is_named() -> None:
    """An install made without the local-k8s extra (KMock hidden from this Python) is told what to install."""
    hide_kmock = ("import sys; sys.modules['kmock'] = None; from kvfleet.cli import main; "
                  f"sys.exit(main(['up', '--kubernetes', '--port', '{free_port()}']))")
    done = subprocess.run([sys.executable, "-c", hide_kmock], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'kvfleet[local-k8s]'" in done.stderr and "Traceback" not in done.stderr


def third_party_imports(folders: list[str]) -> dict[str, set[str]]:
    """Distribution -> the files importing it, for every non-standard-library import in those folders."""
    dists = packages_distributions()
    out: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in {"kvfleet", "__future__"}:
                        for dist in dists.get(top, [top]):
                            out.setdefault(dist.lower().replace("_", "-"), set()).add(path.name)
    return out


def test_the_readme_install_brings_everything_the_kubernetes_path_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    installed = names(project["dependencies"]) | names(project["optional-dependencies"]["local-k8s"])
    imported = third_party_imports(["kvfleet", "operator", "gateway", "engine"])
    # charts are optional: matplotlib only inside the chart functions, which say so and go on without it
    missing = {d: files for d, files in imported.items() if d not in installed and d != "matplotlib"}
    at_import_time = [path.name for folder in ("kvfleet", "operator", "gateway", "engine")
                      for path in (ROOT / folder).rglob("*.py") for node in ast.parse(path.read_text()).body
                      if isinstance(node, ast.Import | ast.ImportFrom) and "matplotlib" in ast.unparse(node)]
    assert not at_import_time, f"matplotlib imported at module level (it is optional): {at_import_time}"
    assert not missing, f"imported at run time but in no dependency of `pip install -e '.[local-k8s]'`: {missing}"
    assert "kmock" in names(project["optional-dependencies"]["local-k8s"])
    assert "-e '.[local-k8s]'" in (ROOT / "README.md").read_text()  # the README's install names the extra


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def terminal():
    """What reaches the terminal: the records the root logger's handlers get (pytest's caplog is no witness: from
    pytest 9.2 on it also listens on loggers that do not propagate)."""
    seen = Collect()
    logging.getLogger().addHandler(seen)
    try:
        yield seen.records
    finally:
        logging.getLogger().removeHandler(seen)


def test_verbose_puts_the_access_log_in_the_terminal_too(tmp_path: Path, terminal: list[logging.LogRecord]) -> None:
    for verbose, in_terminal in ((False, False), (True, True)):
        added = route_chatty_logs(tmp_path, verbose)
        try:
            terminal.clear()
            logging.getLogger("aiohttp.access").info("GET /api/v1/pods %s", verbose)
            logging.getLogger("kvfleet.local").warning("local kubelet: an engine exited")
        finally:
            unroute_chatty_logs(added)
        shown = [r.getMessage() for r in terminal]
        assert (f"GET /api/v1/pods {verbose}" in shown) is in_terminal
        assert "local kubelet: an engine exited" in shown  # warnings always reach the terminal
        assert f"GET /api/v1/pods {verbose}" in (tmp_path / "api-access.log").read_text()


@pytest.mark.parametrize(("seconds", "shown"), [(45, "45s"), (200, "3m20s"), (720, "12m"), (5 * 3600 + 180, "5h3m"),
                                               (30 * 3600, "30h"), (3 * 86400 + 5, "3d")])
def test_ages_read_as_kubectl_prints_them(seconds: int, shown: str) -> None:
    assert human_age(seconds) == shown


def running_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fleet's adapter directory: a path "in the image" (the local kubelet runs engines on this filesystem)."""
    root = tmp_path_factory.mktemp("fleet-adapters")
    for seed, name in enumerate(("sql", "poet", "late"), start=1):
        make_adapter(smollm2_dir, root / name, seed=seed, rank=4, targets=("q_proj", "v_proj"), std=0.2)
    return root


@pytest.fixture(scope="module")
def cluster(smollm2_dir, adapters: Path):
    """One local cluster for the module's tests; the last test stops it and checks what is left. Its fleet serves
    two LoRA adapters from spec.loraAdapters."""
    fleet = default_fleet("chat", max_replicas=1)
    fleet["spec"]["lora"] = {"path": str(adapters), "maxLoras": 2}
    fleet["spec"]["loraAdapters"] = [{"name": "sql", "rank": 4}, {"name": "poet", "pinned": True}]
    cluster = LocalCluster(ClusterSpec(fleet, port=free_port(), autoscale_interval_s=2))
    before = set(running_children())  # other tests' processes (the session's vLLM fleet) are not this cluster's
    try:
        cluster.start()
        cluster.processes = [p for p in running_children() if p not in before]
        yield cluster
    finally:
        cluster.stop()


def test_the_kubernetes_path_serves_behind_the_engine_token(cluster: LocalCluster,
                                                             terminal: list[logging.LogRecord]) -> None:
    api = cluster.emulator.api_client()
    dep = client.AppsV1Api(api).read_namespaced_deployment("chat-engine", "kvfleet")
    assert dep.spec.replicas == 1 and dep.metadata.owner_references[0].kind == "InferenceFleet"
    [engine_pod] = client.CoreV1Api(api).list_namespaced_pod("kvfleet").items
    assert engine_pod.status.pod_ip == "127.0.0.1" and engine_pod.metadata.labels["kvfleet.io/fleet"] == "chat"
    # The engine pod takes its token from the Secret, as on a cluster; the token is in no pod spec.
    [token_env] = [e for e in engine_pod.spec.containers[0].env if e.name == "KVFLEET_ENGINE_API_KEY"]
    assert token_env.value is None and token_env.value_from.secret_key_ref.key == "api-key"
    answer = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                        json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
    engine_port = engine_pod.spec.containers[0].ports[0].container_port
    assert answer.status_code == 200 and answer.headers["x-kvfleet-engine"].endswith(str(engine_port))
    direct = httpx.post(f"http://127.0.0.1:{engine_port}/v1/completions", timeout=60,
                        json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
    assert direct.status_code == 401  # past the gateway, without the token: refused
    # All of that went through the API emulator, whose access log went to its file and not to the terminal.
    assert "GET /api/v1/namespaces/kvfleet/pods" in (cluster.run_dir / "api-access.log").read_text()
    assert not [r.getMessage() for r in terminal if "/api/v1/" in r.getMessage()]


def kubectl(cluster: LocalCluster, *args: str) -> str:
    done = subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig), *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_gets_fleets_and_pods_as_on_a_cluster(cluster: LocalCluster) -> None:
    wait_for(lambda: fleet_status(cluster).get("loraAdaptersReady") == "2/2", "both adapters on the pod")
    header, row = kubectl(cluster, "get", "ifleet", "-n", "kvfleet").splitlines()
    assert header.split() == ["NAME", "MODEL", "REPLICAS", "READY", "KV%", "QUEUED", "ADAPTERS", "AGE"]
    assert row.split()[6] == "2/2"
    name, model, replicas, *_, age = row.split()
    assert (name, model, replicas) == ("chat", "smollm2-135m-instruct", "1") and re.fullmatch(r"\d+[smhd].*", age)
    pods = kubectl(cluster, "get", "pods", "-n", "kvfleet").splitlines()
    assert pods[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    [engine] = pods[1:]
    assert engine.startswith("chat-engine-") and engine.split()[1:3] == ["1/1", "Running"]
    assert kubectl(cluster, "get", "inferencefleet", "chat", "-n", "kvfleet", "-o",
                   "jsonpath={.spec.model}") == "smollm2-135m-instruct"


def fleet_status(cluster: LocalCluster) -> dict:
    fleet = client.CustomObjectsApi(cluster.emulator.api_client()).get_namespaced_custom_object(
        "kvfleet.io", "v1alpha1", "kvfleet", "inferencefleets", "chat")
    return fleet.get("status") or {}


def wait_for(check, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def ask(cluster: LocalCluster, model: str) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                      json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})


def test_the_fleets_adapters_follow_its_spec_on_the_live_pod(cluster: LocalCluster) -> None:
    """spec.loraAdapters is loaded onto the ready pod, answered by name through the gateway, and an edit of the list
    loads and unloads on the same pod (no restart); the status names the pods that hold each adapter."""
    api = cluster.emulator.api_client()
    [pod] = client.CoreV1Api(api).list_namespaced_pod("kvfleet").items
    wait_for(lambda: fleet_status(cluster).get("loraAdaptersReady") == "2/2", "both adapters on the pod")
    assert fleet_status(cluster)["loraAdapters"] == [{"name": "sql", "pods": [pod.metadata.name]},
                                                    {"name": "poet", "pods": [pod.metadata.name]}]
    wait_for(lambda: ask(cluster, "sql").status_code == 200, "the gateway to route `sql`", 30)
    sql, base = ask(cluster, "sql").json(), ask(cluster, "smollm2-135m-instruct").json()
    assert sql["model"] == "sql" and sql["choices"][0]["text"] != base["choices"][0]["text"]
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        "kvfleet.io", "v1alpha1", "kvfleet", "inferencefleets", "chat",
        {"spec": {"loraAdapters": [{"name": "poet", "pinned": True}, {"name": "late"}]}})
    wait_for(lambda: [a["name"] for a in fleet_status(cluster).get("loraAdapters", [])] == ["poet", "late"]
             and fleet_status(cluster)["loraAdaptersReady"] == "2/2", "the edited list on the pod")
    assert ask(cluster, "late").json()["model"] == "late"
    assert ask(cluster, "sql").status_code == 404
    [still] = client.CoreV1Api(api).list_namespaced_pod("kvfleet").items
    assert still.metadata.name == pod.metadata.name  # the same pod, never restarted
    engine_port = still.spec.containers[0].ports[0].container_port
    served = httpx.get(f"http://127.0.0.1:{engine_port}/v1/models", timeout=10,
                       headers={"Authorization": f"Bearer {cluster.engine_api_key}"}).json()["data"]
    assert {m["id"]: m.get("pinned", False) for m in served if m.get("parent")} == {"poet": True, "late": False}


def test_stopping_the_kubernetes_path_leaves_nothing_behind(cluster: LocalCluster) -> None:
    children = [p for p in cluster.processes if p.is_running()]
    assert len(children) >= 4  # redis-server, the operator, the gateway, an engine
    cluster.stop()
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more (a bind test would trip on
        socket.create_connection(("127.0.0.1", cluster.spec.port), timeout=2)  # the closed connections' TIME_WAIT)
