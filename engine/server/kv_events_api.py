"""GET /kv_events: the engine's KV-event hub as Server-Sent Events, for any number of gateway replicas (up to the
hub's limit). The first event is a snapshot; a comment every few seconds keeps idle streams alive, so a subscriber
notices a dead engine and the engine a dead subscriber. Each event's `id` is its batch's seq."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from kvfleet.engine.kv_event_hub import KVEventHub, Subscription, TooManySubscribers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.headers import RETRY_AFTER
from kvfleet.fleet.kv_events import KV_EVENTS_PATH, encode_batch

KEEPALIVE_S = 5.0


def install_kv_event_routes(app: FastAPI, state) -> None:  # noqa: ANN001 - api_server.ServerState (no cycle)
    @app.get(KV_EVENTS_PATH, response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}}, "description": "KV-event batches"}})
    async def kv_events() -> StreamingResponse:
        engine = state.require_engine()
        hub: KVEventHub | None = engine.kv_events
        if hub is None:
            raise APIError(404, "this engine does not publish KV events: it runs with --no-kv-events or without "
                                "prefix caching", code="kv_events_off")
        try:
            sub = hub.subscribe()
        except TooManySubscribers as err:
            raise APIError(503, str(err), "service_unavailable", headers={RETRY_AFTER: "5"}) from None
        return StreamingResponse(_stream(hub, sub), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})


async def _stream(hub: KVEventHub, sub: Subscription) -> AsyncIterator[str]:
    try:
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    batch = await sub.queue.get()
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            if batch is None:  # fell too far behind: the subscriber reconnects and starts from a snapshot
                return
            yield f"id: {batch.seq}\ndata: {encode_batch(batch)}\n\n"
    finally:
        hub.unsubscribe(sub)
