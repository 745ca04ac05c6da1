"""A Kubernetes API on loopback for the local fleet and the tests: KMock's emulator (by kopf's author).

It serves the built-in resources and the InferenceFleet resource as stored objects: no scheduler, no controllers,
no garbage collector, no admission. kvfleet/local/kubelet.py plays the controllers' part for engine Deployments.
What it lacks (and how kvfleet copes) is listed where it matters: in the local kubelet and the tests.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
import uuid
import warnings
from pathlib import Path

from kvfleet.local.kube_tables import pods_table, printer_columns_table, wants_table
from kvfleet.operator.fleet_spec import GROUP, PLURAL, VERSION


def _fleet_resource() -> dict:
    """The InferenceFleet as discovery shows it on a cluster with the chart's CRD (short name ifleet)."""
    from kvfleet.operator.crd import build_crd

    names = build_crd()["spec"]["names"]
    return {"kind": names["kind"], "namespaced": True, "singular": names["singular"],
            "shortnames": names["shortNames"], "categories": names["categories"],
            "verbs": ["list", "watch", "get", "patch", "create", "delete", "update"],
            "subresources": ["status", "scale"]}


def _printer_columns() -> list[dict]:
    from kvfleet.operator.crd import build_crd

    return build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]


def _emulator_class():
    """KMock's emulator with what kubectl needs and KMock 0.8 lacks: lists that say their kind; the core group's
    resource list named `v1` (KMock says `/v1`, so kubectl finds no pods); subresources without short names;
    Tables for `kubectl get` of fleets and pods; a creationTimestamp and uid on every object created; lists and
    watches filtered by their labelSelector (two fleets' pods were each other's)."""
    import kmock

    columns = _printer_columns()

    class Emulator(kmock.KubernetesEmulator):
        async def _handle(self, request):  # noqa: ANN001, ANN202 - kmock's own signature
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                meta.setdefault("creationTimestamp", _now().strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta.setdefault("uid", str(uuid.uuid4()))
            return await super()._handle(request)

        async def _serve_version(self, request):  # noqa: ANN001, ANN202
            payload = await super()._serve_version(request)
            # Subresources have no short names or categories on a real server (else kubectl warns per use).
            resources = [{**r, "shortNames": [], "categories": []} if "/" in r["name"] else r
                         for r in payload["resources"]]
            return {**payload, "groupVersion": payload["groupVersion"].lstrip("/"), "resources": resources}

        async def _serve_list(self, request):  # noqa: ANN001, ANN202
            payload = await super()._serve_list(request)
            selector = request.params.get("labelSelector")
            if selector:
                payload = {**payload, "items": [o for o in payload["items"] if selects(selector, _labels(o))]}
            wanted = request.resource
            accept = next((v for k, v in request.headers.items() if k.lower() == "accept"), "")
            if wants_table(accept) and (wanted.group, wanted.plural) == (GROUP, PLURAL):
                return printer_columns_table(payload["items"], columns, _now())
            if wants_table(accept) and (wanted.group, wanted.plural) == ("", "pods"):
                return pods_table(payload["items"], _now())
            kinds = [info.kind for resource, info in self.resources.items() if resource == wanted]
            version = f"{wanted.group}/{wanted.version}" if wanted.group else wanted.version
            return {"apiVersion": version, "kind": f"{kinds[0]}List", **payload} if kinds else payload

        async def _serve_watch(self, request):  # noqa: ANN001, ANN202
            selector = request.params.get("labelSelector")
            async for event in super()._serve_watch(request):
                if not selector or not isinstance(event, dict) or selects(selector, _labels(event.get("object"))):
                    yield event

    return Emulator


def _labels(obj: object) -> dict:
    return ((obj or {}).get("metadata") or {}).get("labels") or {} if isinstance(obj, dict) else {}


def selects(selector: str, labels: dict) -> bool:
    """Whether a Kubernetes label selector (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, joined
    by commas) selects these labels: KMock 0.8 ignores labelSelector, so every list and watch got every object."""
    for term in _terms(selector):
        if " notin " in term or " in " in term:
            key, op, values = term.partition(" notin ") if " notin " in term else term.partition(" in ")
            allowed = {v.strip() for v in values.strip().strip("()").split(",")}
            if (labels.get(key.strip()) in allowed) == (op.strip() == "notin"):
                return False
        elif "!=" in term:
            key, _, value = term.partition("!=")
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, _, value = term.replace("==", "=").partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _terms(selector: str) -> list[str]:
    """The comma-separated terms, commas inside `in (...)` sets kept."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    return [t for t in [*terms, current.strip()] if t]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


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
            emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = _fleet_resource()
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
