"""A request the gateway admitted is routed even when, by the time it is picked, every engine looks saturated:
requests admitted together (a burst at 32 clients) fill the fleet before their picks, and the Python proxy
answered some of them 503 `no_engine` (70 of 2,184 in the overhead benchmark's peak). The least-loaded healthy
engine takes it and queues it itself, as it does for a request released from the fleet queue."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvfleet.fleet.load import EngineLoad
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.director import Admission, Ticket
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.limits.access import Tenant
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys
from kvfleet.gateway.proxy import Forwarder
from kvfleet.gateway.routing.router import Router
from tests.support.stand_in_engine import StandInEngine


def test_an_admitted_request_goes_to_a_saturated_engine_rather_than_503() -> None:
    engine = StandInEngine()
    try:
        pool = EndpointPool()
        pool.set_urls([engine.url])
        # the engine's queue at the saturation threshold: the saturation filter leaves nothing to pick
        pool.record_scrape(engine.url, EngineLoad(kv_cache_usage=0.2, num_running=8, num_waiting=5))

        async def send() -> httpx.Response:
            async with httpx.AsyncClient() as client:
                config = GatewayConfig(engines=[engine.url])
                forwarder = Forwarder(config, client, Router(config, pool, PrefixRouting(), GatewayMetrics()))
                body = json.dumps({"model": "stand-in", "prompt": "hello"}).encode()
                admission = Admission(None, Ticket(Priority.STANDARD, None, Tenant("default"), 30_000.0), body,
                                      changed=False, hashes=PromptKeys([]), settlement=None, degraded=None,
                                      queued=False, share=None, has_capacity=True)
                return await forwarder.forward(admission, "/v1/completions", {"content-type": "application/json"},
                                               "rid")

        response = asyncio.run(send())
        assert response.status_code == 200, bytes(response.body)
        assert engine.prompts == ["hello"]
    finally:
        engine.close()
