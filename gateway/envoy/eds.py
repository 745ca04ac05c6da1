"""The engines as the gateway's Envoy knows them: their addresses, the EDS file Envoy reads them from, and the
picker's ordered destination list (the router's choice, then the next best) of the Inference Extension's protocol.

Envoy retries onto another engine only among its cluster's members (the override-host load balancer tries the
picker's list in order), so the gateway's engine pool is mirrored into an EDS file that Envoy watches. The file is
replaced by a rename, the one change Envoy's watched_directory reacts to, so Envoy never reads half a file.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.envoy.bootstrap import ENGINES_CLUSTER

log = logging.getLogger("kvfleet.gateway.envoy")

FALLBACKS = 1  # Envoy retries once, as the Python proxy does: one engine after the chosen one is enough


@lru_cache(maxsize=4096)
def envoy_address(url: str) -> str:
    """An engine URL's `ip:port`, as Envoy names its hosts (a host name is resolved once: the protocol's lists
    carry addresses). Raises OSError for a name that does not resolve."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def in_subset(address: str, subset: frozenset[str]) -> bool:
    """Whether an engine's `ip:port` is in the proxy's subset hint (an entry without a port allows every port)."""
    return address in subset or address.rsplit(":", 1)[0].strip("[]") in subset


def outside_subset(urls: Iterable[str], subset: frozenset[str] | None) -> frozenset[str]:
    """The engines the proxy's subset hint leaves out (none without a hint): the picker names only the others."""
    if subset is None:
        return frozenset()
    return frozenset(url for url in urls if not _address_in(url, subset))


def _address_in(url: str, subset: frozenset[str]) -> bool:
    try:
        return in_subset(envoy_address(url), subset)
    except OSError:
        return False


def endpoints_document(addresses: Iterable[str] | Mapping[str, str]) -> dict:
    """The EDS file's content: one ClusterLoadAssignment for the engines' cluster. Each endpoint's hostname is the
    engine's URL as the gateway knows it (`addresses` maps ip:port to it; else http://ip:port): Envoy names the
    engine that served an answer with it (x-kvfleet-engine, %UPSTREAM_HOST_NAME%)."""
    urls = addresses if isinstance(addresses, Mapping) else {a: f"http://{a}" for a in addresses}
    lb_endpoints = []
    for address in sorted(urls):
        host, port = address.rsplit(":", 1)
        lb_endpoints.append({"endpoint": {"hostname": urls[address], "address": {"socket_address": {
            "address": host.strip("[]"), "port_value": int(port)}}}})
    return {"version_info": str(len(lb_endpoints)), "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": ENGINES_CLUSTER, "endpoints": [{"lb_endpoints": lb_endpoints}]}]}


def write_endpoints(path: Path, addresses: Iterable[str] | Mapping[str, str]) -> None:
    """Replaces the EDS file at once (write beside it, then rename)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(endpoints_document(addresses)))
    os.replace(partial, path)


class EndpointsFile:
    """Keeps the EDS file at `path` equal to the gateway's engine pool, rewritten when discovery changes the pool
    (an engine becomes routable only after its first scrape, by when Envoy has the file); `path` lies in a folder
    of its own, which Envoy watches."""

    def __init__(self, pool: EndpointPool, path: Path) -> None:
        self.pool, self.path = pool, path
        self._written: frozenset[str] | None = None
        path.parent.mkdir(parents=True, exist_ok=True)
        write_endpoints(path, ())  # Envoy reads the file at start: it must exist

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            urls = frozenset(self.pool.urls())
            if urls != self._written:
                if all(_is_ip(url) for url in urls):
                    addresses = _resolve_all(urls)
                else:  # a name lookup may block
                    addresses = await loop.run_in_executor(None, _resolve_all, urls)
                write_endpoints(self.path, addresses)
                self._written = urls  # a name that did not resolve is tried again when the pool next changes
            await self.pool.membership_changed.wait()  # discovery changed the pool: no polling in between
            self.pool.membership_changed.clear()


def _is_ip(url: str) -> bool:
    try:
        ipaddress.ip_address(urlsplit(url).hostname or "")
        return True
    except ValueError:
        return False


def _resolve_all(urls: Iterable[str]) -> dict[str, str]:
    """ip:port -> the engine's URL."""
    addresses = {}
    for url in urls:
        try:
            addresses[envoy_address(url)] = url
        except OSError as err:
            log.warning("engine %s left out of Envoy's endpoints: its name does not resolve (%s)", url, err)
    return addresses
