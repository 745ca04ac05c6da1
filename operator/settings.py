"""The operator's own settings (`kvfleet operator` flags); run() hands them to the handlers when it registers
them (handlers.register), so nothing is read from the environment at import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    redis_url: str | None = None  # the gateways' Redis: each fleet's queued requests
    autoscale_interval_s: float = 15.0
    scrape_timeout_s: float = 2.0
    # The Secret (in each fleet's namespace) holding the engines' shared token, for fleets without spec.engineAuth
    engine_api_key_secret: str | None = None
