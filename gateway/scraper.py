"""Scrape every engine's /metrics every 50-100 ms, each engine in its own loop, and hand the load to the pool.

A slow answer leaves the last load in place and lets it age (stale metrics count as saturated); a refused
connection or a bad answer marks the engine unhealthy until a scrape succeeds again. Scrapes that time out for
`unreachable_after_s` in a row mean the engine stopped answering without closing anything (a blackhole): it turns
unhealthy and the gateway's waits on it end at once (EndpointPool.mark_unreachable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from kvfleet.fleet.load import METRICS_QUERY, MetricsParseError, parse_engine_load
from kvfleet.gateway.endpoints import EndpointPool

log = logging.getLogger(__name__)


class Scraper:
    def __init__(self, client: httpx.AsyncClient, pool: EndpointPool, interval_s: float = 0.075,
                 timeout_s: float = 1.0, on_scrape: Callable[[str], None] = lambda url: None,
                 unreachable_after_s: float = 3.0):
        self.client, self.pool, self.interval_s, self.timeout_s = client, pool, interval_s, timeout_s
        self.on_scrape, self.unreachable_after_s = on_scrape, unreachable_after_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._silent_since: dict[str, float] = {}  # start of the first of the scrapes timing out in a row

    def sync(self) -> None:
        """Start a loop for each new endpoint and stop the loops of those that left."""
        for url in list(self._tasks):
            if url not in self.pool.endpoints:
                self._tasks.pop(url).cancel()
                self._silent_since.pop(url, None)
        for url in self.pool.endpoints:
            if url not in self._tasks:
                self._tasks[url] = asyncio.create_task(self._loop(url), name=f"scrape {url}")

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _loop(self, url: str) -> None:
        while url in self.pool.endpoints:
            started = time.monotonic()
            await self.scrape_once(url)
            self.on_scrape(url)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def scrape_once(self, url: str) -> None:
        started = time.monotonic()
        try:
            response = await self.client.get(f"{url}/metrics?{METRICS_QUERY}", timeout=self.timeout_s)
            self._silent_since.pop(url, None)
            if response.status_code != 200:
                self._failed(url, f"/metrics answered {response.status_code}")
                return
            self.pool.record_scrape(url, parse_engine_load(response.text), now=time.monotonic())
        except httpx.TimeoutException:
            # Keep the last load; it ages past the staleness limit and the engine counts as saturated. Silent long
            # enough, the engine is unreachable.
            silent_since = self._silent_since.setdefault(url, started)
            if time.monotonic() - silent_since >= self.unreachable_after_s:
                self._unreachable(url, time.monotonic() - silent_since)
        except (httpx.HTTPError, MetricsParseError) as err:
            self._silent_since.pop(url, None)
            self._failed(url, str(err) or type(err).__name__)

    def _unreachable(self, url: str, silent_s: float) -> None:
        state = self.pool.endpoints.get(url)
        if state is not None and state.scrape_error is None:
            log.warning("engine %s is unreachable: its /metrics has not answered for %.1f s", url, silent_s)
        ended = self.pool.mark_unreachable(url, f"/metrics has not answered for {silent_s:.1f} s",
                                           self.unreachable_after_s)
        if ended:
            log.warning("ended %d request(s) waiting on unreachable engine %s", ended, url)

    def _failed(self, url: str, error: str) -> None:
        state = self.pool.endpoints.get(url)
        if state is not None and state.scrape_error is None:
            log.warning("engine %s is unhealthy: %s", url, error)
        self.pool.record_scrape(url, None, error)
