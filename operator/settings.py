"""The operator's own settings (`kvfleet operator` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OperatorConfig:
    redis_url: str | None = None  # the gateways' Redis: each fleet's queued requests
    autoscale_interval_s: float = 15.0
    scrape_timeout_s: float = 2.0
    # The Secret (in each fleet's namespace) holding the engines' shared token, for fleets without spec.engineAuth
    engine_api_key_secret: str | None = None
