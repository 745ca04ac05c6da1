"""Which LoRA adapters each engine serves, from its GET /v1/models (vLLM and kvfleet list an adapter with its `parent`),
read every few seconds per engine: a request whose `model` is one of them is an adapter's request, routed by adapter
affinity (routing/scorers.py LoraAffinity) and counted per adapter.

An engine's answer is not trusted to be small or sane: at most MAX_BODY bytes and MAX_ADAPTERS names are read, and a
bad answer keeps the engine's last list (an engine that stops answering leaves the pool by its scrapes, not here).
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from kvfleet.fleet import headers
from kvfleet.gateway.engines.loops import PerEngineLoops
from kvfleet.gateway.engines.pool import EndpointPool

log = logging.getLogger(__name__)

POLL_S = 5.0  # an adapter loaded at run time is routed by affinity within this long (before: as any request)
MAX_BODY = 1 << 20
MAX_ADAPTERS = 4096
MAX_NAME = 256


def served_adapters(body: object) -> frozenset[str]:
    """The adapter names in a /v1/models answer (entries with a parent); ValueError for an answer that is not one."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) > MAX_ADAPTERS:
        raise ValueError(f"a /v1/models answer must list at most {MAX_ADAPTERS} models under data")
    return frozenset(m["id"] for m in data if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)
                     and 0 < len(m["id"]) <= MAX_NAME)


class ServedAdapters:
    """Polls each engine of the pool; what it reads goes into the pool (EndpointState.adapters_served)."""

    def __init__(self, pool: EndpointPool, engine_api_key: str | None = None, poll_s: float = POLL_S) -> None:
        self.pool = pool
        self.poll_s = poll_s
        self._headers = {headers.AUTHORIZATION: f"Bearer {engine_api_key}"} if engine_api_key else {}
        self._loops = PerEngineLoops(self._loop, "adapters")
        self.session: aiohttp.ClientSession | None = None

    def sync(self) -> None:
        """Poll the engines whose metrics say they serve adapters (the LoRA gauge), and stop polling those that
        left (on the event loop). Engines without adapters are never asked."""
        lora = [url for url, s in self.pool.endpoints.items() if s.load is not None and s.load.lora is not None]
        if len(lora) == len(self._loops.tasks) and all(url in self._loops.tasks for url in lora):
            return
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0),
                                                 cookie_jar=aiohttp.DummyCookieJar())
        self._loops.sync(lora)

    async def stop(self) -> None:
        await self._loops.stop()
        if self.session is not None:
            await self.session.close()

    def adapter_of(self, model: object) -> str | None:
        """The adapter a body's `model` names, where some engine serves one by that name; None otherwise."""
        if not isinstance(model, str):
            return None
        return model if any(s.adapters_served and model in s.adapters_served
                            for s in self.pool.endpoints.values()) else None

    @property
    def names(self) -> frozenset[str]:
        return frozenset().union(*(s.adapters_served or () for s in self.pool.endpoints.values()))

    async def _loop(self, url: str) -> None:
        while True:
            await self.poll_once(url)
            await asyncio.sleep(self.poll_s)

    async def poll_once(self, url: str) -> None:
        try:
            async with self.session.get(f"{url}/v1/models", headers=self._headers) as response:
                if response.status != 200:
                    return
                raw = await response.content.read(MAX_BODY + 1)
            if len(raw) > MAX_BODY:
                raise ValueError(f"its /v1/models answer is over {MAX_BODY} bytes")
            state = self.pool.endpoints.get(url)
            if state is not None:
                state.adapters_served = served_adapters(json.loads(raw))
        except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as err:
            log.debug("engine %s: its adapters are not known: %s", url, err)
