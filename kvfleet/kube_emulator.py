"""A Kubernetes API on loopback for the local fleet and the tests: KMock's emulator (by kopf's author).

It serves the built-in resources and the InferenceFleet resource as stored objects: no scheduler, no controllers,
no garbage collector, no admission. kvfleet/local_kubelet.py plays the controllers' part for engine Deployments.
What it lacks (and how kvfleet copes) is listed where it matters: in the local kubelet and the tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from pathlib import Path

from kvfleet.operator.fleet_spec import GROUP, PLURAL, VERSION

FLEET_RESOURCE = {"kind": "InferenceFleet", "namespaced": True, "singular": "inferencefleet",
                  "verbs": ["list", "watch", "get", "patch", "create", "delete", "update"],
                  "subresources": ["status", "scale"]}


def _emulator_class():
    """KMock's emulator, with lists that say their kind, as kubectl requires (KMock 0.8 leaves it out)."""
    import kmock

    class Emulator(kmock.KubernetesEmulator):
        async def _serve_list(self, request):  # noqa: ANN001, ANN202 - kmock's own signature
            payload = await super()._serve_list(request)
            wanted = request.resource
            kinds = [info.kind for resource, info in self.resources.items() if resource == wanted]
            version = f"{wanted.group}/{wanted.version}" if wanted.group else wanted.version
            return {"apiVersion": version, "kind": f"{kinds[0]}List", **payload} if kinds else payload

    return Emulator


class KubeEmulator:
    """KMock's emulator and server on an asyncio loop of their own, in a daemon thread."""

    def __init__(self) -> None:
        self.url: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 15.0) -> KubeEmulator:
        self._thread = threading.Thread(target=self._serve, name="kvfleet-kube-emulator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.url is None and self._error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.url is None:
            raise RuntimeError(f"the Kubernetes API emulator did not start: {self._error or 'timed out'}")
        return self

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # reported to start(), which raises it
            self._error = err

    async def _main(self) -> None:
        import kmock

        async with _emulator_class()() as emulator, kmock.Server(emulator) as server:
            with warnings.catch_warnings():  # kmock 0.8 reads its bundled list with a deprecated importlib call
                warnings.simplefilter("ignore", DeprecationWarning)
                emulator.resources.load_bundled()
            emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = FLEET_RESOURCE
            self.url = str(server.url).rstrip("/")
            while not self._stop.is_set():
                await asyncio.sleep(0.05)

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that points kubectl, kopf and the kubernetes client at this emulator."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kvfleet-local",
            "clusters": [{"name": "kvfleet-local", "cluster": {"server": self.url}}],
            "users": [{"name": "kvfleet-local", "user": {"token": "local"}}],
            "contexts": [{"name": "kvfleet-local", "context": {"cluster": "kvfleet-local", "user": "kvfleet-local"}}],
        }))
        return path

    def api_client(self):
        from kubernetes.client import ApiClient, Configuration

        return ApiClient(Configuration(host=self.url, api_key={"BearerToken": "local"}))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
