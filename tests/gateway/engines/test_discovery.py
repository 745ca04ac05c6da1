"""Which engines the gateway sees: a fixed list, or the ready pods of a fleet in a Kubernetes API (KMock's emulator)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import kmock
import pytest
from kubernetes.client import (
    ApiClient,
    Configuration,
    V1Container,
    V1ContainerPort,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from kvfleet.fleet.pods import pod_endpoint
from kvfleet.gateway.engines.discovery import KubernetesDiscovery, StaticDiscovery

# kmock 0.8 reads its bundled resource list with a deprecated importlib call.
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")

NAMESPACE = "serving"
SELECTOR = "app.kubernetes.io/name=kvfleet-engine,kvfleet.io/fleet=chat"


def run(scenario: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    """Run one scenario on a fresh event loop, failing rather than hanging."""
    asyncio.run(asyncio.wait_for(scenario, timeout))


def engine_pod(name: str, ip: str | None = "10.0.0.5", ready: bool | None = True, namespace: str = NAMESPACE,
               fleet: str = "chat", http_port: int = 8000, finalizers: list[str] | None = None) -> dict[str, Any]:
    """An engine pod as the API server would show it once scheduled; `ready=None` means no Ready condition yet.

    KMock's emulator assigns no server-side fields (uid, resourceVersion, creationTimestamp). Discovery keys
    pods by namespace/name and needs none of them, so these pods carry none.
    """
    status: dict[str, Any] = {"phase": "Running"}
    if ip is not None:
        status["podIP"] = ip
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {
        "app.kubernetes.io/name": "kvfleet-engine", "app.kubernetes.io/instance": fleet, "kvfleet.io/fleet": fleet}}
    if finalizers:
        metadata["finalizers"] = finalizers
    ports = [{"name": "metrics-sidecar", "containerPort": 9100}, {"name": "http", "containerPort": http_port}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
            "spec": {"containers": [{"name": "engine", "image": "kvfleet/engine:cpu", "ports": ports}]},
            "status": status}


def _labels_match(selector: str | None, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!"):
            raise NotImplementedError(f"this test emulator only knows equality selectors, not {term!r}")
        if labels.get(key) != value:
            return False
    return True


class FleetEmulator(kmock.KubernetesEmulator):
    """KMock's Kubernetes emulator, plus what discovery relies on and kmock 0.8 lacks, plus failures on demand.

    - kmock 0.8 ignores `labelSelector` on list and watch (it filters by namespace and name only), so this applies
      equality selectors as a real API server does; a discovery that forgot to send its selector would still fail.
    - `failing_lists`: the next N lists answer 500, as an API server that is briefly unavailable.
    - `expiring_watches`: the next N watches answer a 410 Gone ERROR event, as for a resource version that is too old.
    - `ending_watches`: the next N watches end at once with no events, as when `timeoutSeconds` runs out (kmock 0.8
      ignores `timeoutSeconds` and keeps every watch open until the client goes).
    """

    failing_lists = 0
    expiring_watches = 0
    ending_watches = 0
    lists = 0
    watches = 0

    async def _serve_list(self, request: kmock.Request) -> Any:
        self.lists += 1
        if self.failing_lists:
            self.failing_lists -= 1
            raise kmock.KubernetesError(status=500, reason="InternalError", message="etcd is having a bad day")
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        return {**payload, "items": [item for item in payload["items"] if _labels_match(selector, item)]}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        self.watches += 1
        if self.expiring_watches:
            self.expiring_watches -= 1
            yield b""
            yield {"type": "ERROR", "object": {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                               "code": 410, "reason": "Expired",
                                               "message": "too old resource version: 1 (2)"}}
            return
        if self.ending_watches:
            self.ending_watches -= 1
            yield b""
            return
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            # Besides events, the stream yields b"" to send its headers; pass those through.
            if not isinstance(event, dict) or _labels_match(selector, event.get("object") or {}):
                yield event

    def pod_path(self, namespace: str, name: str = "") -> str:
        return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")

    async def create_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        await self._expect_ok(self.post(self.pod_path(meta["namespace"]), json=pod))

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        # The emulator merges dicts and replaces lists (no strategic merge): send whole lists, as here `conditions`.
        await self._expect_ok(self.patch(self.pod_path(namespace, name), json=patch))

    async def delete_pod(self, namespace: str, name: str) -> None:
        await self._expect_ok(self.delete(self.pod_path(namespace, name)))

    @staticmethod
    async def _expect_ok(request: Any) -> None:
        response = await request
        assert response.status == 200, await response.text()


@contextlib.asynccontextmanager
async def kubernetes_api() -> AsyncIterator[tuple[FleetEmulator, ApiClient]]:
    """The emulator served on loopback, and an official-client ApiClient that points at it."""
    async with FleetEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources.load_bundled()  # without the built-in resources the emulator does not know pods
        configuration = Configuration(host=str(server.url).rstrip("/"), api_key={"BearerToken": "any-token"},
                                      api_key_prefix={"BearerToken": "Bearer"})
        api_client = ApiClient(configuration)
        try:
            yield emulator, api_client
        finally:
            api_client.close()


class Seen:
    """What the gateway was told: every full set of engine URLs, and on which threads it was told."""

    def __init__(self) -> None:
        self.sets: list[frozenset[str]] = []
        self.threads: set[int] = set()

    def __call__(self, urls: frozenset[str]) -> None:
        self.sets.append(urls)
        self.threads.add(threading.get_ident())

    @property
    def latest(self) -> frozenset[str] | None:
        return self.sets[-1] if self.sets else None

    async def settles_on(self, *urls: str, timeout: float = 5.0) -> None:
        expected = frozenset(urls)
        await wait_until(lambda: self.latest == expected, f"expected {sorted(expected)}; the gateway saw {self.sets}",
                         timeout)


async def wait_until(condition: Callable[[], bool], failure: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(failure)
        await asyncio.sleep(0.02)


def watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvfleet-pod-watch-")]


@contextlib.asynccontextmanager
async def discovering(discovery: KubernetesDiscovery | StaticDiscovery) -> AsyncIterator[Seen]:
    """Run discovery as the gateway does; on the way out, cancel it and check that it stopped cleanly."""
    seen = Seen()
    task = asyncio.create_task(discovery.run(seen))
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_until(lambda: not watch_threads(), f"watch threads still running: {watch_threads()}", 3.0)
    assert seen.threads <= {threading.get_ident()}, "on_change must run on the event loop's thread"


def fleet_discovery(api_client: ApiClient) -> KubernetesDiscovery:
    discovery = KubernetesDiscovery(NAMESPACE, SELECTOR, api_client=api_client)
    discovery.min_backoff_seconds = 0.05  # keep the retry tests short
    return discovery


def test_ready_pod_is_discovered_at_its_ip_and_http_port() -> None:
    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            await emulator.create_pod(engine_pod("chat-0", ip="10.0.0.5", http_port=8001))
            async with discovering(fleet_discovery(api_client)) as seen:
                await seen.settles_on("http://10.0.0.5:8001")  # from the initial list
                await emulator.create_pod(engine_pod("chat-1", ip="10.0.0.6"))
                await seen.settles_on("http://10.0.0.5:8001", "http://10.0.0.6:8000")  # from the watch

    run(scenario())


def test_unready_unaddressed_and_foreign_pods_are_left_out() -> None:
    def others(suffix: str) -> list[dict[str, Any]]:
        return [
            engine_pod(f"starting-{suffix}", ip="10.0.1.1", ready=None),  # no Ready condition yet
            engine_pod(f"unready-{suffix}", ip="10.0.1.2", ready=False),
            engine_pod(f"pending-{suffix}", ip=None),  # Ready but not yet given an IP
            engine_pod(f"other-fleet-{suffix}", ip="10.0.1.3", fleet="code"),  # the selector does not match
            engine_pod(f"other-ns-{suffix}", ip="10.0.1.4", namespace="staging"),  # same labels, other namespace
        ]

    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            for pod in [engine_pod("chat-0", ip="10.0.0.5"), *others("listed")]:
                await emulator.create_pod(pod)
            async with discovering(fleet_discovery(api_client)) as seen:
                await seen.settles_on("http://10.0.0.5:8000")
                for pod in others("watched"):
                    await emulator.create_pod(pod)
                await emulator.create_pod(engine_pod("chat-1", ip="10.0.0.6"))  # arrives after all the others
                await seen.settles_on("http://10.0.0.5:8000", "http://10.0.0.6:8000")
            reported = set().union(*seen.sets)
            assert reported == {"http://10.0.0.5:8000", "http://10.0.0.6:8000"}

    run(scenario())


def test_pod_turning_unready_leaves_at_once_and_comes_back_when_ready() -> None:
    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            await emulator.create_pod(engine_pod("chat-0", ip="10.0.0.5"))
            await emulator.create_pod(engine_pod("chat-1", ip="10.0.0.6"))
            async with discovering(fleet_discovery(api_client)) as seen:
                await seen.settles_on("http://10.0.0.5:8000", "http://10.0.0.6:8000")
                unready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
                await emulator.patch_pod(NAMESPACE, "chat-0", unready)
                await seen.settles_on("http://10.0.0.6:8000")
                ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
                await emulator.patch_pod(NAMESPACE, "chat-0", ready)
                await seen.settles_on("http://10.0.0.5:8000", "http://10.0.0.6:8000")
            # The watch, not a periodic re-list, carried the changes: one list, one watch.
            assert (emulator.lists, emulator.watches) == (1, 1)

    run(scenario())


def test_deleted_and_terminating_pods_leave() -> None:
    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            await emulator.create_pod(engine_pod("chat-0", ip="10.0.0.5"))
            # A finalizer keeps chat-1 around after the delete, with a deletionTimestamp, as in graceful termination.
            await emulator.create_pod(engine_pod("chat-1", ip="10.0.0.6", finalizers=["test/hold"]))
            await emulator.create_pod(engine_pod("chat-2", ip="10.0.0.7"))
            async with discovering(fleet_discovery(api_client)) as seen:
                await seen.settles_on("http://10.0.0.5:8000", "http://10.0.0.6:8000", "http://10.0.0.7:8000")
                await emulator.delete_pod(NAMESPACE, "chat-0")
                await seen.settles_on("http://10.0.0.6:8000", "http://10.0.0.7:8000")
                await emulator.delete_pod(NAMESPACE, "chat-1")  # still Ready, but terminating
                await seen.settles_on("http://10.0.0.7:8000")
                await emulator.delete_pod(NAMESPACE, "chat-2")
                await seen.settles_on()

    run(scenario())


def test_discovery_outlives_an_unavailable_api_and_an_expired_watch(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            emulator.failing_lists = 2
            emulator.expiring_watches = 1
            await emulator.create_pod(engine_pod("chat-0", ip="10.0.0.5"))
            async with discovering(fleet_discovery(api_client)) as seen:
                await seen.settles_on("http://10.0.0.5:8000")
                await wait_until(lambda: emulator.watches == 2, "discovery did not watch again after the 410")
                await emulator.create_pod(engine_pod("chat-1", ip="10.0.0.6"))
                await seen.settles_on("http://10.0.0.5:8000", "http://10.0.0.6:8000")
            # Two failed lists, then a list whose watch expired, then a list and the watch that carried chat-1.
            assert (emulator.lists, emulator.watches) == (4, 2)

    with caplog.at_level(logging.WARNING, logger="kvfleet.gateway.engines.discovery"):
        run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    assert all("HTTP 500" in w for w in warnings[:2]), warnings
    assert "HTTP 410" in warnings[2], warnings


def test_watch_that_runs_out_is_renewed_quietly(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            emulator.ending_watches = 1
            await emulator.create_pod(engine_pod("chat-0", ip="10.0.0.5"))
            async with discovering(fleet_discovery(api_client)) as seen:
                await wait_until(lambda: emulator.watches == 2, "discovery did not watch again after the watch ended")
                await emulator.create_pod(engine_pod("chat-1", ip="10.0.0.6"))
                await seen.settles_on("http://10.0.0.5:8000", "http://10.0.0.6:8000")
            assert (emulator.lists, emulator.watches) == (2, 2)
            assert seen.sets == [{"http://10.0.0.5:8000"}, {"http://10.0.0.5:8000", "http://10.0.0.6:8000"}]

    with caplog.at_level(logging.WARNING, logger="kvfleet.gateway.engines.discovery"):
        run(scenario())
    assert not caplog.records


def test_without_an_api_client_discovery_reads_the_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: the in-cluster config is skipped

    async def scenario() -> None:
        async with kubernetes_api() as (emulator, api_client):
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "kmock", "cluster": {"server": api_client.configuration.host}}],
                "users": [{"name": "tester", "user": {"token": "any-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "tester"}}]}))
            monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
            await emulator.create_pod(engine_pod("chat-0", ip="10.0.0.5"))
            async with discovering(KubernetesDiscovery(NAMESPACE, SELECTOR)) as seen:
                await seen.settles_on("http://10.0.0.5:8000")

    run(scenario())


def test_without_any_kubernetes_config_the_error_says_what_to_do(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="not running in a pod, and no usable kubeconfig.*set KUBECONFIG"):
        KubernetesDiscovery(NAMESPACE, SELECTOR)


def test_static_discovery_reports_its_urls_and_runs_until_cancelled() -> None:
    async def scenario() -> None:
        discovery = StaticDiscovery(["http://127.0.0.1:8001/", "https://engine-0.example:8443", "http://[::1]:8002"])
        async with discovering(discovery) as seen:
            await seen.settles_on("http://127.0.0.1:8001", "https://engine-0.example:8443", "http://[::1]:8002")
            await asyncio.sleep(0.05)
            assert len(seen.sets) == 1

    run(scenario())


@pytest.mark.parametrize("url", ["10.0.0.5:8000", "ftp://10.0.0.5:8000", "http://10.0.0.5", "http://:8000",
                                 "http://10.0.0.5:http", "http://10.0.0.5:8000/v1", "http://10.0.0.5:8000?x=1",
                                 "http://user:secret@10.0.0.5:8000", ""])
def test_bad_static_url_is_refused_with_a_message_naming_it(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        StaticDiscovery(["http://10.0.0.9:8000", url])
    assert repr(url) in str(refused.value)
    assert "http://10.0.0.5:8000" in str(refused.value)  # the hint shows the expected form


def test_pod_endpoint_of_a_ready_pod() -> None:
    assert pod_endpoint(engine_pod("a", ip="10.0.0.5", http_port=8001)) == "http://10.0.0.5:8001"
    assert pod_endpoint(engine_pod("a", ip="fd00::5")) == "http://[fd00::5]:8000"


def test_pod_endpoint_port_falls_back_to_8000_and_follows_port_name() -> None:
    pod = engine_pod("a", ip="10.0.0.5", http_port=8001)
    assert pod_endpoint(pod, port_name="metrics-sidecar") == "http://10.0.0.5:9100"
    assert pod_endpoint(pod, port_name="api") == "http://10.0.0.5:8000"
    pod["spec"]["containers"][0].pop("ports")
    assert pod_endpoint(pod) == "http://10.0.0.5:8000"


def test_pod_endpoint_is_none_for_pods_not_to_route_to() -> None:
    assert pod_endpoint(engine_pod("a", ready=False)) is None
    assert pod_endpoint(engine_pod("a", ready=None)) is None
    assert pod_endpoint(engine_pod("a", ip=None)) is None
    terminating = engine_pod("a")
    terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert pod_endpoint(terminating) is None
    other_condition = engine_pod("a", ready=None)
    other_condition["status"]["conditions"] = [{"type": "ContainersReady", "status": "True"}]
    assert pod_endpoint(other_condition) is None
    assert pod_endpoint({}) is None


def test_pod_endpoint_takes_client_models_too() -> None:
    def model(ready: str) -> V1Pod:
        return V1Pod(metadata=V1ObjectMeta(name="a", namespace=NAMESPACE),
                     spec=V1PodSpec(containers=[V1Container(name="engine", ports=[
                         V1ContainerPort(name="http", container_port=8001)])]),
                     status=V1PodStatus(pod_ip="10.0.0.5", conditions=[V1PodCondition(type="Ready", status=ready)]))

    assert pod_endpoint(model("True")) == "http://10.0.0.5:8001"
    assert pod_endpoint(model("False")) is None
