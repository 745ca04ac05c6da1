"""The gateway with Envoy running apart from it: this process serves the endpoint picker on --picker-port
(ext_proc, and grpc.health.v1, with which the Inference Extension's gateways health-check an EPP) and its own HTTP
app (/health, /ready, /metrics, /v1/models) on --host:--port, and starts no Envoy.

`--data-plane envoy-sidecar`: the Envoy beside it (the chart's sidecar of the official image) runs kvfleet's own
bootstrap (gateway/envoy/sidecar.py) and calls the picker on 127.0.0.1, where alone it listens (the picker puts
the engines' token on the requests it routes); this process also takes Envoy's access log (usage, outcomes) and
keeps the engines' EDS file current in the folder both containers share. `--data-plane picker`: an
Inference-Extension Gateway's Envoy calls the picker on --host, and knows the engines from the InferencePool.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import grpc
import uvicorn
from envoy.service.accesslog.v3.als_pb2_grpc import add_AccessLogServiceServicer_to_server
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import add_ExternalProcessorServicer_to_server
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvfleet.fleet.http_server import server_config
from kvfleet.gateway.app import build_app
from kvfleet.gateway.core import Gateway
from kvfleet.gateway.envoy.eds import EndpointsFile
from kvfleet.gateway.envoy.ext_proc import EndpointPicker, picker_server
from kvfleet.gateway.envoy.feed import EnvoyFeed
from kvfleet.gateway.envoy.handoff import Handoffs
from kvfleet.gateway.envoy.lua import ACCESS_LOG_FLUSH_S

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class CountedPicker(EndpointPicker):
    """The picker, counting its open streams: at shutdown it waits for them, not for Envoy's access-log stream
    (which lasts as long as Envoy)."""

    def __init__(self, gateway: Gateway, feed: EnvoyFeed | None, handoffs: Handoffs | None = None) -> None:
        super().__init__(gateway, feed, handoffs)
        self.open_streams = 0

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC's name)
        self.open_streams += 1
        try:
            await super().Process(request_iterator, context)
        finally:
            self.open_streams -= 1


async def start_network_picker(gateway: Gateway, host: str, port: int, feed: EnvoyFeed | None,
                               handoffs: Handoffs | None = None
                               ) -> tuple[grpc.aio.Server, CountedPicker, health.aio.HealthServicer]:
    """The picker's gRPC server on host:port, with a health service that says SERVING for it and for "" (overall);
    `handoffs`: where it parks the requests it hands to the app (envoy/handoff.py)."""
    server = picker_server(gateway)
    picker = CountedPicker(gateway, feed, handoffs)
    add_ExternalProcessorServicer_to_server(picker, server)
    if feed is not None:
        add_AccessLogServiceServicer_to_server(feed, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") == 0:
        raise SystemExit(f"kvfleet gateway: cannot listen on {host}:{port} for the picker (port in use?)")
    await server.start()
    for service in ("", EXT_PROC_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    gateway.picker_serving = True  # /ready says so too
    return server, picker, health_servicer


async def serve_picker_only(gateway: Gateway, host: str, port: int, drain_timeout: float) -> int:
    config = gateway.config
    # the chart's sidecar Envoy hands answers it can migrate to this app, as kvfleet's Envoy child does
    handoffs = Handoffs() if config.hands_off and config.data_plane == "envoy-sidecar" else None
    server = uvicorn.Server(server_config(build_app(gateway, handoffs), host, port, drain_timeout,
                                          config.http_limits, backlog=4096))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            return 1
        await asyncio.sleep(0.05)
    # SIGTERM is ours, not uvicorn's: the app's shutdown stops the queue and the scrapes that the streams the
    # picker holds still need, so the picker drains first.
    asked_to_stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, asked_to_stop.set)
    feed, endpoints, picker_host = None, None, host
    if config.data_plane == "envoy-sidecar":
        picker_host = "127.0.0.1"
        feed = EnvoyFeed(gateway.pool, gateway.metrics)
        endpoints = asyncio.create_task(EndpointsFile(gateway.pool, Path(config.envoy_endpoints_file)).run())
    grpc_server, picker, health_servicer = await start_network_picker(gateway, picker_host, config.picker_port,
                                                                       feed, handoffs)
    print(f"kvfleet gateway: endpoint picker (ext_proc, grpc.health.v1) on {picker_host}:{config.picker_port}; "
          "Envoy runs apart from this process", file=sys.stderr, flush=True)
    stop_asked = asyncio.create_task(asked_to_stop.wait())
    try:
        await asyncio.wait({serving, stop_asked}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _drain_picker(grpc_server, picker, health_servicer, drain_timeout)
        if endpoints is not None:
            endpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await endpoints
        if feed is not None:
            await feed.stop()
        server.should_exit = True
        stop_asked.cancel()
        await serving
    return 0


async def _drain_picker(grpc_server: grpc.aio.Server, picker: CountedPicker,
                        health_servicer: health.aio.HealthServicer, drain_timeout: float) -> None:
    """Health says NOT_SERVING (Envoy stops opening streams here); open streams get drain_timeout, then Envoy's
    last access-log entries a flush interval."""
    await health_servicer.enter_graceful_shutdown()
    picker.gateway.picker_serving = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_timeout
    while picker.open_streams and loop.time() < deadline:
        await asyncio.sleep(0.1)
    await grpc_server.stop(grace=ACCESS_LOG_FLUSH_S + 0.5 if picker.feed is not None else 0.5)
