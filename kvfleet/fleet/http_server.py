"""The uvicorn settings every kvfleet HTTP server (engine, gateway) shares."""

from __future__ import annotations

import uvicorn

from kvfleet.fleet.engine_settings import KEEP_ALIVE_S
from kvfleet.fleet.http_limits import HttpLimits, limited_protocol


def server_config(app, host: str, port: int, drain_timeout: float, limits: HttpLimits | None = None,
                  **extra) -> uvicorn.Config:
    """Quiet logs, a graceful shutdown that lets in-flight requests finish, the long keep-alive above, and the
    header, slow-client and connection limits of `limits` (http_limits.py)."""
    limits = limits or HttpLimits()
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_timeout,
                          timeout_keep_alive=KEEP_ALIVE_S, http=limited_protocol(limits), **extra)
