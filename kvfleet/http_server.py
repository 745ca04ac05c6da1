"""The uvicorn settings every kvfleet HTTP server (engine, gateway) shares."""

from __future__ import annotations

import uvicorn

# Longer than clients' idle keep-alive (httpx: 5 s, the gateway's pool: 30 s): a server that closes an idle
# connection just as a client reuses it makes that request fail with no answer.
KEEP_ALIVE_S = 75


def server_config(app, host: str, port: int, drain_timeout: float, **extra) -> uvicorn.Config:
    """Quiet logs, a graceful shutdown that lets in-flight requests finish, and the long keep-alive above."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_timeout,
                          timeout_keep_alive=KEEP_ALIVE_S, **extra)
