"""Which engines the gateway routes to: a fixed list, or the ready pods a label selector picks in Kubernetes."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvfleet.fleet.pods import ENGINE_PORT_NAME, pod_endpoint

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from kubernetes.watch import Watch

logger = logging.getLogger(__name__)

OnChange = Callable[[frozenset[str]], None]  # the full set of ready engine base URLs

URL_HINT = "engine URLs look like http://10.0.0.5:8000"


def normalize_engine_url(url: str) -> str:
    """`http(s)://host:port` without a trailing slash; anything else is a ValueError that names the URL."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"engine URL {url!r} has an invalid port; {URL_HINT}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL {url!r} must start with http:// or https:// and name a host; {URL_HINT}")
    if port is None:
        raise ValueError(f"engine URL {url!r} has no port; {URL_HINT}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"engine URL {url!r} must hold only a scheme, host and port "
                         f"(no path, query or credentials); {URL_HINT}")
    return f"{parts.scheme}://{parts.netloc}"


def _pod_key(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace')}/{metadata.get('name')}"


class StaticDiscovery:
    """A fixed list of engines: the local fleet, or engines that run outside Kubernetes."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = frozenset(normalize_engine_url(url) for url in urls)

    async def run(self, on_change: OnChange) -> None:
        on_change(self.urls)
        await asyncio.Event().wait()  # nothing ever changes; run until cancelled


class KubernetesDiscovery:
    """The ready pods that a label selector picks in one namespace, kept current by list + watch."""

    min_backoff_seconds = 0.5
    max_backoff_seconds = 10.0

    def __init__(self, namespace: str, selector: str, port_name: str = ENGINE_PORT_NAME,
                 api_client: ApiClient | None = None, *, watch_timeout_seconds: int = 30) -> None:
        from kubernetes.client import CoreV1Api  # importing the client takes a second; static fleets never need it

        self.namespace = namespace
        self.selector = selector
        self.port_name = port_name
        self.watch_timeout_seconds = watch_timeout_seconds
        self._api = CoreV1Api(api_client or _default_api_client())
        self._endpoints: dict[str, str] = {}  # "namespace/name" -> URL, for ready pods only
        self._reported: frozenset[str] | None = None

    async def run(self, on_change: OnChange) -> None:
        """List, then watch; on any failure log a warning, back off and start over. Runs until cancelled."""
        loop = asyncio.get_running_loop()
        backoff = self.min_backoff_seconds
        while True:
            started = loop.time()
            try:
                await self._list_and_watch(on_change)
            except Exception as err:  # discovery must outlive any API trouble; cancellation still passes through
                logger.warning("watching pods %r in namespace %s failed (%s); listing again in %.1fs",
                               self.selector, self.namespace, _describe(err), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_seconds)
                continue
            # The watch ran out its timeout: list again (fresh resource version), then watch again. A server that
            # ends watches at once must not make this a busy loop.
            backoff = self.min_backoff_seconds
            if loop.time() - started < 1.0:
                await asyncio.sleep(backoff)

    async def _list_and_watch(self, on_change: OnChange) -> None:
        endpoints, resource_version = await asyncio.to_thread(self._list_endpoints)
        self._endpoints = endpoints
        self._report(on_change)

        from kubernetes.watch import Watch

        # A daemon thread, not the default executor: asyncio.run() and interpreter exit wait for executor threads,
        # and a watch read can block until the server's timeout. watch.stop() below usually ends it at once.
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        stopping = threading.Event()
        watch = Watch()
        thread = threading.Thread(target=self._stream_events, name=f"kvfleet-pod-watch-{self.namespace}",
                                  args=(watch, resource_version, loop, finished, stopping, on_change), daemon=True)
        thread.start()
        try:
            await finished
        finally:
            stopping.set()
            watch.stop()  # shuts the socket down, so a read blocked in the thread returns now

    def _list_endpoints(self) -> tuple[dict[str, str], str | None]:
        """In a thread: the ready pods now, and the resource version to watch from."""
        pods = self._api.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector,
                                             _request_timeout=(10, 30))
        endpoints = {}
        for pod in pods.items:
            raw = pod.to_dict(serialize=True)
            url = pod_endpoint(raw, self.port_name)
            if url is not None:
                endpoints[_pod_key(raw)] = url
        return endpoints, pods.metadata.resource_version if pods.metadata else None

    def _stream_events(self, watch: Watch, resource_version: str | None, loop: asyncio.AbstractEventLoop,
                       finished: asyncio.Future[None], stopping: threading.Event, on_change: OnChange) -> None:
        """In a thread: hand each watch event to the event loop, then how the watch ended."""
        options: dict[str, Any] = dict(namespace=self.namespace, label_selector=self.selector,
                                       timeout_seconds=self.watch_timeout_seconds,
                                       _request_timeout=(10, self.watch_timeout_seconds + 15))
        if resource_version:
            options["resource_version"] = resource_version
        error: Exception | None = None
        try:
            for event in watch.stream(self._api.list_namespaced_pod, **options):
                if stopping.is_set():
                    return
                loop.call_soon_threadsafe(self._apply_event, event["type"], event["raw_object"], stopping, on_change)
        except Exception as err:  # reported to the event loop, which logs it and starts over
            error = err
        if stopping.is_set():
            return  # stopped from the loop (cancelled): the read was cut short on purpose
        try:
            loop.call_soon_threadsafe(_settle, finished, error)
        except RuntimeError:
            pass  # the event loop is closed: nobody waits for this watch any more

    def _apply_event(self, kind: str, pod: dict[str, Any], stopping: threading.Event, on_change: OnChange) -> None:
        if stopping.is_set() or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        key = _pod_key(pod)
        url = None if kind == "DELETED" else pod_endpoint(pod, self.port_name)
        if url is None:
            self._endpoints.pop(key, None)  # unready, terminating or gone: stop routing to it at once
        else:
            self._endpoints[key] = url
        self._report(on_change)

    def _report(self, on_change: OnChange) -> None:
        ready = frozenset(self._endpoints.values())
        if ready == self._reported:
            return
        previous = self._reported or frozenset()
        logger.info("engines in %s (%s): %d ready; added %s, removed %s", self.namespace, self.selector, len(ready),
                    sorted(ready - previous) or "none", sorted(previous - ready) or "none")
        self._reported = ready
        try:
            on_change(ready)
        except Exception:
            logger.exception("the gateway failed to take the new set of engines")


def _settle(finished: asyncio.Future[None], error: Exception | None) -> None:
    if finished.done():
        return
    if error is None:
        finished.set_result(None)
    else:
        finished.set_exception(error)


def _describe(err: Exception) -> str:
    status = getattr(err, "status", None)
    if isinstance(status, int):  # kubernetes.client.ApiException; 410 Gone means the resource version expired
        return f"HTTP {status} {getattr(err, 'reason', '') or ''}".strip()
    return f"{type(err).__name__}: {err}"


def _default_api_client() -> ApiClient:
    """In a pod, the service account; elsewhere, the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config
    from kubernetes.client import ApiClient, Configuration

    configuration = Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            # KUBECONFIG read now, not when the kubernetes package was first imported (which is its own default).
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
        except (config.ConfigException, OSError) as err:
            raise RuntimeError(f"cannot find the Kubernetes API: not running in a pod, and no usable kubeconfig "
                               f"({err}); set KUBECONFIG, or give the gateway static engine URLs") from None
    return ApiClient(configuration)
