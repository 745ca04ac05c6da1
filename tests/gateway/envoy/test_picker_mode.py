"""`kvfleet gateway --data-plane picker` (issue 22, the chart's Envoy sidecar and `gateway.mode: inferencePool`):
the gateway serves the endpoint picker (ext_proc) and grpc.health.v1 on --picker-port and its HTTP app on --port,
and starts no Envoy. An Envoy started apart from it, from the bootstrap the chart's init container writes
(`python -m kvfleet.gateway.envoy.sidecar`), carries a completion to a real engine through that picker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.gateway.envoy.front import envoy_binary
from kvfleet.gateway.envoy.picker_mode import EXT_PROC_SERVICE
from kvfleet.local.supervisor import spawn
from tests.conftest import _launch, free_port, start_gateway, stop_process
from tests.support.gateways import wait_until_routable


@pytest.fixture(scope="module")
def picker(tiny_server: str):
    picker_port = free_port()
    proc, url = start_gateway("--engine", tiny_server, "--data-plane", "picker", "--picker-port", str(picker_port),
                              timeout=90.0)
    wait_until_routable(url)
    serving_within(picker_port, 30)  # the gRPC server starts after the HTTP app answers
    yield proc, url, picker_port
    stop_process(proc)


def health_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def serving_within(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if health_status(port, "") == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"the picker on {port} never said SERVING"
        time.sleep(0.1)


def children_of(pid: int) -> list[str]:
    """Command names of the processes whose parent is pid (Linux /proc)."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                names.append((stat.parent / "comm").read_text().strip())
        except (OSError, IndexError, ValueError):
            continue
    return names


def listening_addresses(port: int) -> set[str]:
    """The addresses a TCP port listens on (Linux /proc/net/tcp and tcp6, where gRPC's IPv4 sockets show as
    v4-mapped), IPv4 ones as dotted quads."""
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            if table == "tcp6" and address[:24] in ("0000000000000000FFFF0000", "00000000000000000000FFFF"):
                address = address[24:]
            elif table == "tcp6":
                out.add("::" if set(address) == {"0"} else address)
                continue
            out.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_the_picker_port_answers_grpc_health_serving_and_no_envoy_runs(picker) -> None:
    proc, url, picker_port = picker
    assert health_status(picker_port, "") == health_pb2.HealthCheckResponse.SERVING
    assert health_status(picker_port, EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        health_status(picker_port, "no.such.Service")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert not [name for name in children_of(proc.pid) if "envoy" in name]
    # --port serves the app itself: readiness, metrics, models; generation is Envoy's to carry, not this port's
    assert httpx.get(f"{url}/ready").json()["available"] == 1
    assert "kvfleet_gateway" in httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/v1/models").status_code == 200


def test_a_sidecar_envoy_from_the_init_containers_bootstrap_routes_through_the_picker(tiny_server,
                                                                                       tmp_path: Path) -> None:
    app_port, picker_port, envoy_port = free_port(), free_port(), free_port()
    flags = ["--data-plane", "envoy-sidecar", "--port", str(app_port), "--picker-port", str(picker_port),
             "--envoy-endpoints-file", str(tmp_path / "engines" / "engines.json"), "--engine", tiny_server]
    bootstrap = tmp_path / "envoy.json"
    written = subprocess.run([sys.executable, "-m", "kvfleet.gateway.envoy.sidecar", "--out", str(bootstrap),
                              "--envoy-host", "127.0.0.1", "--envoy-port", str(envoy_port),
                              "--envoy-admin-port", str(free_port()), *flags], capture_output=True, text=True,
                             timeout=60)
    assert written.returncode == 0, written.stderr
    assert json.loads(bootstrap.read_text())["static_resources"]["listeners"][0]["address"]["socket_address"] == \
        {"address": "127.0.0.1", "port_value": envoy_port}
    # the pod's order: the init container's files, then Envoy and the gateway container side by side
    envoy = spawn("envoy", [envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "warn"],
                  url=f"http://127.0.0.1:{envoy_port}", new_session=False, tail_lines=50)
    gateway = None
    try:
        gateway = _launch(["gateway", "--host", "0.0.0.0", *flags], app_port, "gateway")
        gateway.wait_ready("/health", 90)
        assert not [name for name in children_of(gateway.pid) if "envoy" in name]
        wait_until_routable(f"http://127.0.0.1:{envoy_port}")  # Envoy's route to the app's /ready
        # the probes reach the app on the pod's address; only Envoy, beside it, reaches the picker
        assert listening_addresses(app_port) == {"0.0.0.0"}
        deadline = time.monotonic() + 10  # the picker starts listening just after the app answers /health
        while not listening_addresses(picker_port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listening_addresses(picker_port) == {"127.0.0.1"}
        model = httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{envoy_port}/v1/completions",
                       json={"model": model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-kvfleet-engine"] == tiny_server  # the picker chose it; Envoy carried it
        refused = httpx.post(f"http://127.0.0.1:{envoy_port}/v1/completions",
                             json={"model": model, "prompt": "x", "max_tokens": "4"}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
        gateway.send_signal(signal.SIGTERM)  # as the kubelet stops the pod: the picker drains, the app stops
        assert gateway.wait(20) == 0
    finally:
        if gateway is not None:
            stop_process(gateway)
        envoy.stop(10)


def test_the_sidecar_bootstrap_refuses_clashing_ports() -> None:
    done = subprocess.run([sys.executable, "-m", "kvfleet.gateway.envoy.sidecar", "--envoy-port", "9002",
                           "--data-plane", "envoy-sidecar", "--envoy-endpoints-file", "/tmp/x/engines.json",
                           "--port", "8081", "--picker-port", "9002"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "must differ" in done.stderr


def test_ready_is_503_while_the_picker_does_not_serve() -> None:
    """The app answers before the picker listens (its startup starts what the picker needs) and after the picker
    drains: /ready says so (the chart's probe and `kvfleet up` wait on it), so Envoy is not sent traffic it would
    answer 503 picker_unavailable."""
    from starlette.testclient import TestClient

    from kvfleet.gateway.app import build_app
    from kvfleet.gateway.config import GatewayConfig
    from kvfleet.gateway.core import Gateway

    with TestClient(build_app(Gateway(GatewayConfig(data_plane="python")))) as client:
        assert client.get("/ready").status_code == 200  # no picker in this process: as ever
    gateway = Gateway(GatewayConfig(data_plane="envoy-sidecar", envoy_endpoints_file="/nonexistent/engines.json"))
    with TestClient(build_app(gateway)) as client:  # the app and its gateway, in this process, no engines
        r = client.get("/ready")  # the picker is not listening yet (start_network_picker turns it on)
        assert r.status_code == 503 and r.json()["status"] == "picker not serving"
        gateway.picker_serving = True
        assert client.get("/ready").json()["status"] == "ready"
