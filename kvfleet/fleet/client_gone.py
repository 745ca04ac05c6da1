"""Abandoned work stops: a client that disconnects while a non-streaming answer is being made cancels that work.

In the gateway, cancelling the wait closes the engine connection mid-request, which is how an engine (ours or vLLM)
learns to abort the request and free its KV cache; in the engine, cancelling the answer aborts the request's
sequences. Streams need no help: Starlette cancels a stream's relay when its client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvfleet.fleet.errors import APIError

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone; call it only after the request body was read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(receive: Receive, work: Awaitable[T]) -> T:
    """The result of `work`, or APIError 499 (nginx's "client closed request") as soon as the client disconnects,
    with `work` cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "the client closed the connection before the answer was ready", code="client_closed")
    finally:
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
