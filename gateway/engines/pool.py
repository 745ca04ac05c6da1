"""The gateway's view of its engines: last scraped load, its own dispatches since, failures and ejection."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvfleet.fleet.load import EngineLoad
from kvfleet.gateway.engines.learned import Learned, filled, learn
from kvfleet.gateway.routing.pick import EndpointSnapshot

MAX_ADAPTERS_KEPT = 4096  # adapters whose latest engine the pool remembers
QUIET_AFTER_S = 2.0  # an engine this gateway has sent nothing and awaits nothing from for this long is quiet


@dataclass
class EndpointState:
    url: str
    load: EngineLoad | None = None
    scraped_at: float | None = None  # monotonic time of the last successful scrape
    scrape_error: str | None = None
    scrape_interval_s: float = 0.0  # how often it is scraped now (the scraper's cost budget may slow a costly one)
    dispatched_since_scrape: int = 0
    dispatch_tokens: float = 0.0  # a moving average of the prompt tokens (not cached there) of requests sent to it
    open_requests: int = 0
    critical_pending: int = 0  # critical requests sent to it whose answer has not started (EndpointPool.critical_sent)
    critical_tokens: int = 0  # their prompt tokens not cached there
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    waits: dict[asyncio.Timeout, float] = field(default_factory=dict)  # waits on its answers -> loop time begun
    adapters_sent: set[str] = field(default_factory=set)  # adapters of requests sent since the scrape
    adapters_served: frozenset[str] | None = None  # the adapters its /v1/models lists (gateway/engines/adapters.py)
    adapters_last: set[str] = field(default_factory=set)  # adapters whose latest request went here
    last_active: float = float("-inf")  # pool clock time of the last request sent to it or ended there
    learned: Learned = Learned()  # what its scrapes taught of what it does not export (vLLM's batch size...)
    # set by each request sent to it: a scraper pausing long on a quiet engine wakes (scraper.py)
    sent: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)


@dataclass
class EndpointPool:
    """Mutated only on the event loop; routing reads immutable snapshots of it."""

    eject_after_failures: int = 3
    eject_seconds: float = 10.0
    endpoints: dict[str, EndpointState] = field(default_factory=dict)
    # set when set_urls adds or removes an engine (whoever mirrors the membership, e.g. Envoy's EDS file, clears it)
    membership_changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    # each adapter's latest engine (its weights likely still read there), the oldest forgotten past MAX_ADAPTERS_KEPT
    last_engine: OrderedDict[str, str] = field(default_factory=OrderedDict, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)  # a simulation's, in bench/

    def set_urls(self, urls: Iterable[str]) -> tuple[set[str], set[str]]:
        """Discovery's full set; returns (added, removed). A removed engine leaves the pool at once."""
        wanted = set(urls)
        added = wanted - self.endpoints.keys()
        removed = self.endpoints.keys() - wanted
        for url in removed:
            del self.endpoints[url]
        for url in added:
            self.endpoints[url] = EndpointState(url)
        if added or removed:
            self.membership_changed.set()
        return added, removed

    def urls(self) -> list[str]:
        return list(self.endpoints)

    def record_scrape(self, url: str, load: EngineLoad | None, error: str | None = None,
                      now: float | None = None, interval_s: float = 0.0) -> None:
        state = self.endpoints.get(url)
        if state is None:
            return
        if load is None:
            state.scrape_error = error
            return
        state.learned = learn(state.learned, load)
        state.load, state.scraped_at = filled(load, state.learned), self.clock() if now is None else now
        state.scrape_error = None
        state.scrape_interval_s = interval_s
        state.dispatched_since_scrape = 0
        state.adapters_sent = set()

    def mark_unreachable(self, url: str, error: str, silent_s: float) -> int:
        """The engine stopped answering even its /metrics: unhealthy, and each wait on it that has itself seen
        nothing for `silent_s` ends now, as a timeout (the proxy retries it or ends the stream with an error);
        a stream still flowing from an engine that is only slow to report is left alone. Returns how many ended."""
        state = self.endpoints.get(url)
        if state is None:
            return 0
        state.scrape_error = error
        now = asyncio.get_running_loop().time()
        silent = [wait for wait, since in state.waits.items() if now - since >= silent_s and not wait.expired()]
        for wait in silent:
            wait.reschedule(now)
        return len(silent)

    def watch(self, url: str, wait: asyncio.Timeout) -> None:
        state = self.endpoints.get(url)
        if state is not None:
            state.waits[wait] = asyncio.get_running_loop().time()

    def unwatch(self, url: str, wait: asyncio.Timeout) -> None:
        state = self.endpoints.get(url)
        if state is not None:
            state.waits.pop(wait, None)

    def quiet(self, url: str, now: float | None = None) -> bool:
        """Whether this gateway has nothing open on the engine and sent it nothing for QUIET_AFTER_S: its load then
        changes only by other clients' requests, and it may be scraped less often (scraper.py)."""
        state = self.endpoints.get(url)
        if state is None:
            return False
        now = self.clock() if now is None else now
        return (state.open_requests == 0 and state.dispatched_since_scrape == 0
                and now - state.last_active >= QUIET_AFTER_S)

    def _sent(self, state: EndpointState) -> None:
        state.last_active = self.clock()
        state.sent.set()

    def record_expected(self, url: str, tokens: int = 0) -> None:
        """Another replica is about to send this engine a request: count it like one of ours until the scrape."""
        state = self.endpoints.get(url)
        if state is not None:
            self._sent(state)
            state.dispatched_since_scrape += 1
            state.dispatch_tokens = average_tokens(state.dispatch_tokens, tokens)

    def record_dispatch(self, url: str, tokens: int = 0, adapter: str | None = None) -> None:
        """A request (of `tokens` prompt tokens, when known; for `adapter`, if it names one) sent to the engine."""
        state = self.endpoints.get(url)
        if state is not None:
            if adapter is not None:
                state.adapters_sent.add(adapter)
                self._sent_adapter(adapter, state)
            self._sent(state)
            state.dispatched_since_scrape += 1
            state.dispatch_tokens = average_tokens(state.dispatch_tokens, tokens)
            state.open_requests += 1

    def _sent_adapter(self, adapter: str, state: EndpointState) -> None:
        before = self.last_engine.pop(adapter, None)
        if before is not None and before != state.url and before in self.endpoints:
            self.endpoints[before].adapters_last.discard(adapter)
        self.last_engine[adapter] = state.url
        state.adapters_last.add(adapter)
        if len(self.last_engine) > MAX_ADAPTERS_KEPT:
            oldest, url = self.last_engine.popitem(last=False)
            if url in self.endpoints:
                self.endpoints[url].adapters_last.discard(oldest)

    def critical_sent(self, url: str, tokens: int = 0) -> Callable[[], None]:
        """A critical request (of `tokens` prompt tokens not cached there) sent to the engine: counted in its
        critical_pending and critical_tokens until the returned call, which the sender makes once the answer starts or
        the request ends without one (error, retry, client gone); calls after the first do nothing, so a count can
        neither leak nor go twice."""
        state = self.endpoints.get(url)
        if state is None:
            return nothing_counted
        tokens = max(0, tokens)
        state.critical_pending += 1
        state.critical_tokens += tokens
        counted = True

        def started() -> None:
            nonlocal counted
            if counted:
                counted = False
                state.critical_pending = max(0, state.critical_pending - 1)
                state.critical_tokens = max(0, state.critical_tokens - tokens)
        return started

    def record_done(self, url: str, ok: bool | None, now: float | None = None) -> bool:
        """Returns True when this failure ejected the endpoint for its cool-off. ok None: an answer that says nothing
        about the engine's health (busy, or the request's own fault) neither counts nor clears failures."""
        state = self.endpoints.get(url)
        if state is None:
            return False
        state.open_requests = max(0, state.open_requests - 1)
        state.last_active = self.clock()
        return False if ok is None else self.record_outcome(url, ok, now)

    def record_outcome(self, url: str, ok: bool, now: float | None = None) -> bool:
        """An outcome of the engine's; returns True when this failure ejected it. While it is ejected, outcomes of
        requests sent before the ejection (behind Envoy they arrive a flush interval late) count for nothing."""
        state = self.endpoints.get(url)
        if state is None:
            return False
        now = self.clock() if now is None else now
        if now < state.ejected_until:
            return False
        if ok:
            state.consecutive_failures = 0
            return False
        state.consecutive_failures += 1
        if state.consecutive_failures >= self.eject_after_failures:
            state.ejected_until = now + self.eject_seconds
            state.consecutive_failures = 0
            return True
        return False

    def snapshots(self, now: float | None = None) -> list[EndpointSnapshot]:
        now = self.clock() if now is None else now
        out = []
        for s in self.endpoints.values():
            healthy = s.load is not None and s.scrape_error is None and now >= s.ejected_until
            load = s.load
            out.append(EndpointSnapshot(
                url=s.url, healthy=healthy,
                kv_cache_usage=load.kv_cache_usage if load else 1.0,
                num_waiting=load.num_waiting if load else 0,
                num_running=load.num_running if load else 0,
                metrics_age_s=now - s.scraped_at if s.scraped_at is not None else float("inf"),
                scrape_interval_s=s.scrape_interval_s,
                in_flight=unseen(s), max_num_seqs=load.max_num_seqs if load else None,
                prefill_tokens_pending=load.prefill_tokens_pending if load else 0,
                prefill_rate=load.prefill_tokens_per_second if load else None,
                in_flight_tokens=round(unseen(s) * s.dispatch_tokens),
                slot_seconds=load.request_slot_seconds if load else None, critical_pending=s.critical_pending,
                critical_pending_tokens=s.critical_tokens,
                lora=load.lora if load else None, adapters_sent=frozenset(s.adapters_sent),
                adapters_served=s.adapters_served, adapters_last=frozenset(s.adapters_last)))
        return out


def unseen(s: EndpointState) -> int:
    """Requests on their way to the engine that its last scrape did not show: those sent since the scrape, or, if
    more, this gateway's open requests beyond everything the engine reported (a busy engine parses and queues new
    requests late, so a fresh scrape can still miss many; counting them keeps a burst from flooding one engine)."""
    if s.load is None:
        return s.dispatched_since_scrape
    return max(s.dispatched_since_scrape, s.open_requests - s.load.num_running - s.load.num_waiting)


def average_tokens(average: float, tokens: int) -> float:
    """The unseen requests' prompt tokens are estimated as their count (unseen) times this moving average: a busy
    engine reports new requests late, so the tokens sent since the last scrape undercount them as the count does."""
    return float(tokens) if average == 0.0 else 0.8 * average + 0.2 * tokens


def nothing_counted() -> None:
    """critical_sent's end for a request it did not count (not critical, or its engine left the pool)."""
