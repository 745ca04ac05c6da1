"""The Batch API attached to a gateway's app (`--batch-dir` or `--batch-store`): its Redis state, its file store, the
runner on this replica, and the routes. Off without either; it needs --redis-url (state every replica shares)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI

from kvfleet.gateway.batch.api import BatchService, install_batch_routes
from kvfleet.gateway.batch.capacity import BatchRoom
from kvfleet.gateway.batch.files import open_store
from kvfleet.gateway.batch.runner import BatchRunner
from kvfleet.gateway.batch.state import BatchState
from kvfleet.gateway.limits.access import authenticate, request_tenant


class BatchApi:
    def __init__(self, gateway: Any, clock: Callable[[], float] = time.time) -> None:
        """`gateway`: one fleet's core (gateway/core.py) or a front of several (models/front.py); both answer
        batch_models() (model name -> the core serving it) and hold the API keys."""
        import redis.asyncio

        c = gateway.config
        settings = c.batch
        assert c.redis_url, "GatewayConfig refuses the Batch API without --redis-url"
        self.gateway = gateway
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        # a connection Redis dropped (a restart) is made again and the command retried, a few times, not failed
        self.redis = redis.asyncio.Redis.from_url(
            c.redis_url, socket_timeout=5, socket_connect_timeout=5,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self.state = BatchState(self.redis, c.fleet)
        self.files = open_store(settings.store)
        self.runner = BatchRunner(self.state, self.files, gateway.batch_models, BatchRoom(share=settings.share),
                                  clock=clock, metrics=gateway.metrics, file_ttl_s=settings.file_ttl_s)
        self.service = BatchService(self.state, self.files, settings, self.tenant_of, self.runner.wake, clock,
                                    self.token_limit_of)

    def tenant_of(self, request_headers: Mapping[str, str]) -> str:
        return request_tenant(authenticate(self.gateway.keys, request_headers), request_headers).name

    def token_limit_of(self, request_headers: Mapping[str, str]) -> int | None:
        """The caller's key's batch_tokens=, else the gateway's --batch-max-tokens (None: no limit)."""
        key = authenticate(self.gateway.keys, request_headers)
        own = getattr(key, "batch_tokens", None)
        return own if own is not None else self.gateway.config.batch.max_tokens

    def install(self, app: FastAPI) -> None:
        install_batch_routes(app, self.service)

    def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        await self.redis.aclose()
