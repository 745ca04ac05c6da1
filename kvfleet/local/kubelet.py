"""The controllers and kubelet of a one-machine cluster: engine Deployments in the API become engine processes.

Against the API emulator (kvfleet/local/kube_emulator.py), which stores objects but runs nothing, this does what a
ReplicaSet controller and the kubelet do for the operator's engine Deployments, and only that:
- keeps `spec.replicas` engine processes per Deployment, running its container's command and args (host and
  port swapped for 127.0.0.1 and a free port) with its env (secretKeyRef values read from the Secret), each shown
  as a Pod with the template's labels, podIP 127.0.0.1 and the real port as the `http` container port;
- marks a Pod Ready while its readiness probe's path answers 200 (/ready; vLLM's /health), and writes the
  Deployment's status;
- runs a `vllm` container with this machine's vLLM (kvfleet/local/vllm.py), its model from the node's cache, its KV
  events on loopback, pinned to the core fewest pods use (as a static CPU manager would);
- a Pod deleted through the API (or scaled away) has its container's preStop sleep first, while the gateway, which
  watches the Pods, stops routing to it; then SIGTERM (the engine finishes what it holds), and SIGKILL to its whole
  process tree once terminationGracePeriodSeconds have passed since the deletion, as a kubelet does;
  a process that exits on its own has its Pod deleted, and a new one takes its place.
Not emulated: scheduling, resources, images, other probes, rolling updates (a changed template is not rolled).
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.fleet.ports import free_port
from kvfleet.local.supervisor import Child, Supervisor, http_ok
from kvfleet.local.vllm import VllmInstall

log = logging.getLogger("kvfleet.local")
ENGINE_APP = "kvfleet-engine"


def _now() -> str:
    """RFC 3339 in UTC to the second, as a kubelet writes a condition's lastTransitionTime."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodProcess:
    name: str
    deployment: str
    proc: Child
    port: int
    log_path: Path
    ready_path: str = "/ready"
    cores: tuple[int, ...] = ()  # a vLLM pod's cores, as a kubelet's static CPU manager pins them
    ready: bool = False
    prestop_s: float = 0.0  # its container's preStop sleep
    grace_s: float = 30.0  # its terminationGracePeriodSeconds


def termination(container: dict, pod_spec: dict) -> tuple[float, float]:
    """A Pod's (preStop sleep, termination grace) in seconds: the container's `lifecycle.preStop.sleep.seconds` (0
    without one) and the Pod's `terminationGracePeriodSeconds` (Kubernetes' default 30)."""
    sleep = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    grace = pod_spec.get("terminationGracePeriodSeconds")
    return float(sleep.get("seconds") or 0), float(30 if grace is None else grace)


@dataclass
class Stopping:
    """A Pod on its way out, as a kubelet stops one: its preStop sleep from `since`, then SIGTERM; SIGKILL once its
    grace (counted from `since`, the sleep included) has passed."""

    pod: PodProcess
    since: float
    sent: set[signal.Signals] = field(default_factory=set)

    def due(self, now: float) -> signal.Signals | None:
        """The signal to send now, if any: each once (a SIGKILLed process may take a sync or two to be reaped)."""
        if now - self.since >= self.pod.grace_s:
            due = signal.SIGKILL
        elif now - self.since >= min(self.pod.prestop_s, self.pod.grace_s):
            due = signal.SIGTERM
        else:
            return None
        if due in self.sent:
            return None
        self.sent.add(due)
        return due


def pods_to_stop(pods: list[PodProcess], desired: int) -> list[PodProcess]:
    """A ReplicaSet's choice when it has too many: not-ready pods first, then the newest."""
    surplus = len(pods) - desired
    if surplus <= 0:
        return []
    order = sorted(range(len(pods)), key=lambda k: (pods[k].ready, -k))
    return [pods[k] for k in order[:surplus]]


def local_command(container: dict, port: int, vllm: Callable[[list[str]], list[str]] | None = None) -> list[str]:
    """The container's command and args, listening on 127.0.0.1:port; `kvfleet` runs as this Python's module, and
    `vllm` as `vllm(argv)` makes it (kvfleet/local/vllm.py: local_serve_argv)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv and argv[0] == "kvfleet":
        argv = [sys.executable, "-m", "kvfleet.cli", *argv[1:]]
    elif argv and argv[0] == "vllm" and vllm is not None:
        argv = vllm(argv)
    out, skip = [], False
    for k, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--host", "--port") and k + 1 < len(argv):
            skip = True
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def readiness_path(container: dict) -> str:
    """Where the container's readiness probe asks (kvfleet's engine: /ready; vLLM: /health)."""
    return ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path") or "/ready"


def least_used_core(pods: list[PodProcess], cores: list[int]) -> int:
    """The core the fewest running pods are pinned to (the lowest of a tie)."""
    return min(cores, key=lambda core: (sum(core in p.cores for p in pods), core))


class LocalKubelet:
    def __init__(self, api_client, namespace: str, run_dir: Path, env: dict[str, str] | None = None,
                 period_s: float = 0.5, vllm: VllmInstall | None = None) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.apps, self.core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
        self.namespace, self.run_dir, self.period_s = namespace, run_dir, period_s
        self.env = dict(env) if env is not None else dict(os.environ)
        self.pods: dict[str, PodProcess] = {}
        self.stopping: dict[str, Stopping] = {}  # deleted Pods whose process has not exited yet
        self.vllm = vllm  # what runs a `vllm` container (None: the one find_vllm names, when one comes)
        self.procs = Supervisor(run_dir)  # every engine it started; a deleted Pod's stays until it has exited
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LocalKubelet:
        self._thread = threading.Thread(target=self._loop, name="kvfleet-local-kubelet", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sync()
            except Exception as err:  # the API may blink; the next round tries again
                log.warning("local kubelet: %s", err)

    def sync(self) -> None:
        deployments = [d for d in self.apps.list_namespaced_deployment(self.namespace).items
                       if (d.metadata.labels or {}).get("app.kubernetes.io/name") == ENGINE_APP]
        listed = {p.metadata.name for p in self.core.list_namespaced_pod(self.namespace).items}
        self._stop_leaving(time.monotonic())
        for pod in list(self.pods.values()):
            if pod.name not in listed:  # deleted through the API: stop it gracefully
                self._terminate(pod)
            elif pod.proc.poll() is not None:  # died on its own: its Pod goes, a new one replaces it
                log.warning("local kubelet: %s exited with %s (log %s)", pod.name, pod.proc.returncode, pod.log_path)
                self._delete(pod)
            else:
                self._probe(pod)
        for dep in deployments:
            mine = [p for p in self.pods.values() if p.deployment == dep.metadata.name]
            desired = dep.spec.replicas or 0
            for pod in pods_to_stop(mine, desired):
                self._delete(pod)
            for _ in range(desired - len(mine)):
                self._create(dep)
            self._write_status(dep)
        for gone in {p.deployment for p in self.pods.values()} - {d.metadata.name for d in deployments}:
            for pod in [p for p in self.pods.values() if p.deployment == gone]:
                self._delete(pod)
        self.procs.prune()

    def _create(self, dep) -> None:
        template = dep.spec.template
        container = self.api_client.sanitize_for_serialization(template.spec.containers[0])
        name = f"{dep.metadata.name}-{uuid.uuid4().hex[:5]}"
        port = free_port()
        env = {**self.env, **self._container_env(container)}
        env["HOME"] = self.env.get("HOME", "/tmp")  # the pod's HOME is its emptyDir; here the model cache is at ~
        argv, cores = local_command(container, port), ()
        if container.get("command", [None])[0] == "vllm":
            from kvfleet.engine.model_files import resolve_model
            from kvfleet.local.vllm import engine_env, find_vllm, local_serve_argv

            self.vllm = self.vllm or find_vllm()
            cores = (least_used_core(list(self.pods.values()), sorted(os.sched_getaffinity(0))),)
            argv = local_command(container, port, lambda a: local_serve_argv(a, self.vllm.executable, resolve_model))
            env = engine_env(self.vllm, env, cores=list(cores))
        # One group: a node shutting down stops all its engines at once.
        proc = self.procs.start(name, argv, url=f"http://127.0.0.1:{port}", env=env, group="engines")
        ports = [{**p, "containerPort": port} if p.get("name") == "http" else p for p in container.get("ports", [])]
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "labels": dict(template.metadata.labels),
                             "uid": str(uuid.uuid4()), "ownerReferences": []},
                "spec": {"containers": [{**container, "ports": ports}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}]}}
        self.core.create_namespaced_pod(self.namespace, body)
        prestop_s, grace_s = termination(container, self.api_client.sanitize_for_serialization(template.spec))
        self.pods[name] = PodProcess(name, dep.metadata.name, proc, port, proc.log_path, readiness_path(container),
                                     cores, prestop_s=prestop_s, grace_s=grace_s)
        log.info("local kubelet: started %s on port %d", name, port)

    def _container_env(self, container: dict) -> dict[str, str]:
        """The container's env: plain values, and secretKeyRef values read from the Secret (as the kubelet does)."""
        out = {}
        for entry in container.get("env", []):
            if "value" in entry:
                out[entry["name"]] = entry["value"]
            elif ref := (entry.get("valueFrom") or {}).get("secretKeyRef"):
                secret = self.core.read_namespaced_secret(name=ref["name"], namespace=self.namespace)
                out[entry["name"]] = base64.b64decode((secret.data or {})[ref["key"]]).decode()
        return out

    def _probe(self, pod: PodProcess) -> None:
        ready = http_ok(f"http://127.0.0.1:{pod.port}{pod.ready_path}", timeout_s=1)
        if ready != pod.ready:
            pod.ready = ready
            self.core.patch_namespaced_pod(pod.name, self.namespace, {"status": {
                "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                "lastTransitionTime": _now()}]}})  # the operator measures cold starts by it

    def _write_status(self, dep) -> None:
        mine = [p for p in self.pods.values() if p.deployment == dep.metadata.name]
        ready = sum(1 for p in mine if p.ready)
        status = {"replicas": len(mine), "readyReplicas": ready, "availableReplicas": ready,
                  "observedGeneration": dep.metadata.generation or 1}
        current = dep.status.to_dict() if dep.status else {}
        if (current.get("replicas"), current.get("ready_replicas")) != (len(mine), ready):
            self.apps.patch_namespaced_deployment_status(dep.metadata.name, self.namespace, {"status": status})

    def _delete(self, pod: PodProcess) -> None:
        from kubernetes.client import ApiException

        try:
            self.core.delete_namespaced_pod(pod.name, self.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
        self._terminate(pod)

    def _terminate(self, pod: PodProcess) -> None:
        self.pods.pop(pod.name, None)
        if pod.proc.poll() is None:
            self.stopping[pod.name] = Stopping(pod, time.monotonic())
            self._stop_leaving(time.monotonic())

    def _stop_leaving(self, now: float) -> None:
        """The signals due to the Pods on their way out; those that have exited are done (their tree is ended by
        the supervisor's prune)."""
        for name, leaving in list(self.stopping.items()):
            if leaving.pod.proc.poll() is not None:
                del self.stopping[name]
            elif (sig := leaving.due(now)) is not None:
                log.info("local kubelet: %s gets %s", name, sig.name)
                leaving.pod.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop syncing, then every engine (they drain), as a node shutting down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.pods.clear()
        self.stopping.clear()
        self.procs.stop(timeout_s)
