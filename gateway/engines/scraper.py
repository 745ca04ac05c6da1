"""Scrape every engine's /metrics every 50-100 ms, each engine in its own loop, and hand the load to the pool.

An engine renders its /metrics on its own server, between the requests it serves: the gateway asks for a few names
(METRICS_QUERY), but an engine that ignores the filter (vLLM 0.32 renders all ~53 KB, 15-27 ms of its API server's
event loop on a busy CPU) would spend a third of that loop on scrapes at 13 a second. So an engine whose answer
shows it ignored the filter is scraped no more often than SCRAPE_COST_RATIO times its scrapes' (smoothed)
duration, a few times a second (its staleness limit stretching with it, pick.py); one that filtered keeps the base
interval however slowly a busy moment makes it answer.

An engine this gateway has nothing open on and sent nothing for a while (EndpointPool.quiet), while its fleet queue
is empty, is read once a second instead (QUIET_SCRAPE_INTERVAL_S), and again at once when a request is sent to it or
one is queued: an idle gateway in front of two vLLM engines spent ~22 ms of CPU a second on their scrapes (py-spy:
aiohttp and parsing ~55 KB each), more than smg's whole idle process (10 ms/s). Its load then changes only by other
clients' requests (other gateway replicas, direct clients), which a one-second-old reading still shows, and its
staleness limit stretches with the pause.

A slow answer leaves the last load in place and lets it age (stale metrics count as saturated); a refused
connection or a bad answer marks the engine unhealthy until a scrape succeeds again. Scrapes that time out for
`unreachable_after_s` in a row mean the engine stopped answering without closing anything (a blackhole): it turns
unhealthy and the gateway's waits on it end at once (EndpointPool.mark_unreachable).

Scrapes run ~13 times a second per engine, requests or not, so they have their own aiohttp session: a GET costs
about a quarter of the CPU of one through httpx (2,000 scrapes of a tiny engine on loopback: ~0.24 vs ~0.9 ms).
/metrics is open on engines (engine/server/api_key.py), so no engine token is sent; like Envoy, it reaches engines
directly, never through a proxy named in the environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from kvfleet.fleet.load import METRICS_QUERY, MetricsParseError, parse_engine_load
from kvfleet.gateway.engines.loops import PerEngineLoops
from kvfleet.gateway.engines.pool import EndpointPool

log = logging.getLogger(__name__)

SCRAPE_COST_RATIO = 20.0  # an engine spends at most ~1/20 of its time answering this gateway's scrapes
MAX_SCRAPE_INTERVAL_S = 1.0  # however slow, an engine's load is read every second
SMOOTHING = 0.2  # the weight of the newest scrape's duration in its moving average
FILTERED_BYTES = 16 * 1024  # the load metrics alone are well under 1 KiB; a bigger answer ignored the filter
QUIET_SCRAPE_INTERVAL_S = 1.0  # a quiet engine's pace (EndpointPool.quiet, nothing queued)


def scrape_interval_s(base_s: float, took_s: float | None, body_bytes: int = 0) -> float:
    """The pause between an engine's scrapes: the base interval for an engine that filtered its answer (a small
    body: a slow answer then means a busy engine, which must still be read often), else SCRAPE_COST_RATIO times
    what a scrape takes it (at most MAX_SCRAPE_INTERVAL_S, never below the base)."""
    if took_s is None or body_bytes <= FILTERED_BYTES:
        return base_s
    return max(base_s, min(MAX_SCRAPE_INTERVAL_S, SCRAPE_COST_RATIO * took_s))


class Scraper:
    def __init__(self, pool: EndpointPool, interval_s: float = 0.075, timeout_s: float = 1.0,
                 on_scrape: Callable[[str], None] = lambda url: None, unreachable_after_s: float = 3.0,
                 queued: Callable[[], bool] = lambda: False):
        """Built in a running event loop (the session binds to it); stop() closes the session. `queued`: whether
        the fleet queue holds requests (then every engine is read at its busy pace, for releases)."""
        self.pool, self.interval_s, self.on_scrape, self.queued = pool, interval_s, on_scrape, queued
        self.unreachable_after_s = unreachable_after_s
        # limit=0: one kept-alive connection per engine, however many engines. `total` bounds the connect too, so a
        # blackholed engine's lost SYN times out as its silent socket does.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                                             timeout=aiohttp.ClientTimeout(total=timeout_s),
                                             cookie_jar=aiohttp.DummyCookieJar())
        self._loops = PerEngineLoops(self._loop, "scrape", on_leave=self._forget)
        self._silent_since: dict[str, float] = {}  # start of the first of the scrapes timing out in a row
        self._took: dict[str, float] = {}  # each engine's scrape duration, a moving average (answered scrapes)
        self._size: dict[str, int] = {}  # the size of each engine's last answer

    def sync(self) -> None:
        """Start a loop for each new endpoint and stop the loops of those that left."""
        self._loops.sync(self.pool.endpoints)

    async def stop(self) -> None:
        await self._loops.stop()
        await self.session.close()

    def _forget(self, url: str) -> None:
        self._silent_since.pop(url, None)
        self._took.pop(url, None)
        self._size.pop(url, None)

    def interval_for(self, url: str, quiet: bool = False) -> float:
        busy = scrape_interval_s(self.interval_s, self._took.get(url), self._size.get(url, 0))
        return max(busy, QUIET_SCRAPE_INTERVAL_S) if quiet else busy

    def wake(self) -> None:
        """A request was queued: quiet engines are read at once, and at their busy pace while it waits."""
        for state in self.pool.endpoints.values():
            state.sent.set()

    async def _loop(self, url: str) -> None:
        metrics_url = f"{url}/metrics?{METRICS_QUERY}"
        while (state := self.pool.endpoints.get(url)) is not None:
            started = time.monotonic()
            quiet = self.pool.quiet(url) and not self.queued()
            state.sent.clear()  # a request sent from here on ends a quiet pause
            await self.scrape_once(url, metrics_url, quiet)
            self.on_scrape(url)
            pause = max(0.0, self.interval_for(url, quiet) - (time.monotonic() - started))
            if not quiet or self.interval_for(url) >= QUIET_SCRAPE_INTERVAL_S:
                # a request ends only the pause quietness lengthened: an engine read this slowly anyway (a long
                # --scrape-interval-ms, a costly /metrics) is read at its own pace, busy or not
                await asyncio.sleep(pause)
                continue
            try:
                async with asyncio.timeout(pause):
                    await state.sent.wait()
            except TimeoutError:
                pass

    async def scrape_once(self, url: str, metrics_url: str, quiet: bool = False) -> None:
        started = time.monotonic()
        try:
            async with self.session.get(metrics_url) as response:
                if response.status != 200:
                    self._silent_since.pop(url, None)
                    self._failed(url, f"/metrics answered {response.status}")
                    return
                text = (await response.read()).decode("utf-8", "replace")
            took = time.monotonic() - started
            last = self._took.get(url)
            self._took[url] = took if last is None else (1 - SMOOTHING) * last + SMOOTHING * took
            self._size[url] = len(text)
            self._silent_since.pop(url, None)
            self.pool.record_scrape(url, parse_engine_load(text), now=time.monotonic(),
                                    interval_s=self.interval_for(url, quiet))
        except TimeoutError:  # aiohttp's connect and read timeouts are TimeoutErrors too
            # Keep the last load; it ages past the staleness limit and the engine counts as saturated. Silent long
            # enough, the engine is unreachable.
            silent_since = self._silent_since.setdefault(url, started)
            if time.monotonic() - silent_since >= self.unreachable_after_s:
                self._unreachable(url, time.monotonic() - silent_since)
        except (aiohttp.ClientError, MetricsParseError) as err:
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
