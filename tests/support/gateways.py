"""A running gateway as a test sees it: routable engines, its /metrics, its KV index."""

from __future__ import annotations

import time

import httpx


def wait_until_routable(url: str, engines: int = 1, timeout: float = 30.0) -> None:
    """Until the gateway counts `engines` engines with room (/ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"{url}/ready").json()
        if body["available"] >= engines:
            return
        time.sleep(0.05)
    raise AssertionError(f"the gateway never saw {engines} available engine(s): {body}")


def until_metric(url: str, line: str, timeout: float = 5.0) -> str:
    """The gateway's /metrics once it shows `line`. Behind Envoy an answer is counted from Envoy's access log, which
    reaches the gateway within a flush interval (a quarter of a second), not at the moment the client has it."""
    deadline = time.monotonic() + timeout
    while (text := httpx.get(f"{url}/metrics").text).find(line) < 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in text, f"{line!r} not in the gateway's metrics"
    return text


def gateway_metric(gateway: str, name: str, label: str) -> float:
    """The first sample of `name` whose labels include `label` (0 when there is none)."""
    for line in httpx.get(f"{gateway}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def index_blocks(gateway: str, engine: str) -> float:
    return gateway_metric(gateway, "kvfleet_gateway_kv_index_blocks", f'endpoint="{engine}"')


def counter(metrics: str, name: str) -> float:
    """The sum of every sample of `name` (whatever its labels) in a /metrics page."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))
