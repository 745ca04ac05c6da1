"""Gateway replicas as the simulation runs them: each routes with the gateway's own Router (gateway/routing/router.py:
its strategies, its critical lane, its dispatch bookkeeping in an EndpointPool) and prefix layers (gateway/prefix/:
worth.py, kv_index.py, approximate.py), fed with the replica's own view on the simulation's clock, so the simulator
cannot drift from what it simulates.

A replica sees engine load as of its last scrape (every 75 ms, staggered across replicas) plus its own dispatches
since (the pool's); the precise index takes each engine's KV events `delay` seconds after the engine published them;
the approximate table learns from this replica's own routing only. The oracle sees every engine's cache and load as
they are, with no delay, and picks the lowest estimated TTFT.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence

from bench.prefix_sim.engine import Job, SimEngine
from kvfleet.fleet.load import EngineLoad
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.kv_index import KVIndex
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys
from kvfleet.gateway.routing.pick import (
    EndpointSnapshot,
    RoutingContext,
    free_slots,
    pick,
)
from kvfleet.gateway.routing.router import Router
from kvfleet.gateway.routing.strategies import strategy_named

# policy -> (gateway strategy, prefix layer: None, "approximate" or "precise")
POLICIES: dict[str, tuple[str, str | None]] = {
    "round-robin": ("round-robin", None),
    "least-request": ("least-request", None),
    "approximate prefix": ("kvfleet", "approximate"),
    "precise": ("kvfleet", "precise"),
    "estimated-ttft": ("estimated-ttft", "precise"),
    "prefix-affinity": ("prefix-affinity", "precise"),
    "oracle": ("estimated-ttft", None),  # the lowest estimated TTFT over the true state
    "oracle scoring": ("kvfleet", None),  # kvfleet's weighted scoring over the true state
}
ORACLES = frozenset({"oracle", "oracle scoring"})
EVENT_POLICIES = frozenset(name for name, (_, layer) in POLICIES.items() if layer == "precise")
PATH = "/v1/completions"
_HEX = [f"{t:04x}" for t in range(1 << 16)]  # a token as 4 characters: the approximate table hashes characters


def prompt_body(token_ids: Sequence[int]) -> dict:
    """The request body a replica sees: text for the character table, and the token ids its tokenizer would give."""
    return {"prompt": "".join(map(_HEX.__getitem__, token_ids)), "token_ids": token_ids}


class Replica:
    def __init__(self, index: int, policy: str, engines: list[SimEngine], clock: Callable[[], float],
                 delays: list[float], seed: int) -> None:
        strategy, layer = POLICIES[policy]
        self.index, self.engines, self.clock, self.delays = index, engines, clock, delays
        self.prefix: PrefixRouting | None = None
        if layer is not None:
            tokenize = (lambda path, body: list(body["token_ids"])) if layer == "precise" else None
            self.prefix = PrefixRouting(tokenize, KVIndex(), clock=clock)
            if layer == "precise":
                for engine in engines:
                    self.prefix.index.reset(engine.url)  # subscribed: an empty snapshot, then the stream
        self.pool = EndpointPool(clock=clock)
        self.pool.set_urls([e.url for e in engines])
        self.router = Router(GatewayConfig(routing=strategy), self.pool, self.prefix or PrefixRouting(),
                             GatewayMetrics(), rng=random.Random(seed), clock=clock)
        self.slot = {e.url: k for k, e in enumerate(engines)}
        self.cursors = [0] * len(engines)  # absolute positions in each engine's event log
        self.queue: deque[Job] = deque()

    def scrape(self, now: float) -> None:
        rate = self.engines[0].calibration.prefill_tokens_per_s
        for e in self.engines:
            self.pool.record_scrape(e.url, EngineLoad(e.blocks.usage, len(e.waiting), len(e.running) + len(e.admitted),
                                                      e.shape.max_num_seqs, e.prefill_tokens_pending(), rate), now=now)

    def snapshots(self, now: float) -> list[EndpointSnapshot]:
        return self.pool.snapshots(now)

    def take_events(self, now: float) -> None:
        """Apply every KV event published at least this replica's delay ago."""
        index = self.prefix.index
        for k, engine in enumerate(self.engines):
            log, position, ready = engine.event_log, self.cursors[k] - engine.log_base, now - self.delays[k]
            while position < len(log) and log[position][0] <= ready:
                index.apply(engine.url, log[position][1])
                position += 1
            self.cursors[k] = position + engine.log_base

    def route(self, job: Job, now: float, must: bool = False) -> int | None:
        """The engine this replica sends job to (the Router's choice, its dispatch recorded), or None: every engine
        is saturated and it waits in the queue."""
        keys = PromptKeys([], est_tokens=job.seq.num_prompt_tokens)
        if self.prefix is not None:
            if self.prefix.tokenize is not None:
                self.take_events(now)
            keys = self.prefix.keys(PATH, job.meta["body"])
        urls = self.router.rank(keys, must=must)
        if not urls:
            return None
        self.router.dispatched(keys, urls[0])
        job.meta["replica"] = self
        return self.slot[urls[0]]

    def done(self, job: Job) -> None:
        """Its answer ended: no longer open at its engine, as the proxy records it."""
        self.pool.record_done(self.engines[job.engine].url, None)

    def releasable(self, now: float) -> int:
        """How many queued requests the fleet can take now, by this replica's view (routing/pick.py free_slots)."""
        return free_slots(self.snapshots(now)) if self.queue else 0


class Oracle:
    """Knows every engine's cache and load exactly, with no delay, and routes by a gateway strategy over them:
    estimated TTFT (the brief's oracle), or weighted scoring (greedy TTFT trades cache locality for load, so its hit
    rate is not the most a router can reach; this one shows what scoring reaches with perfect knowledge)."""

    def __init__(self, engines: list[SimEngine], seed: int, policy: str = "oracle") -> None:
        self.engines, self.rng = engines, random.Random(seed)
        self.strategy = strategy_named(POLICIES[policy][0])
        self.queue: deque[Job] = deque()

    def route(self, job: Job, now: float, must: bool = False) -> int | None:
        seq, n = job.seq, job.seq.num_prompt_tokens
        matches = {e.url: e.blocks.cached_prefix_tokens(e.blocks.find_cached_prefix(seq)) / n for e in self.engines}
        endpoints = [EndpointSnapshot(e.url, True, e.blocks.usage, len(e.waiting), len(e.running) + len(e.admitted),
                                      0.0, 0, e.shape.max_num_seqs, e.prefill_tokens_pending(),
                                      e.calibration.prefill_tokens_per_s) for e in self.engines]
        chosen = pick(self.strategy, endpoints, RoutingContext(matches, must=must, num_tokens=n), self.rng)
        return None if chosen is None else next(i for i, e in enumerate(endpoints) if e is chosen)

    def releasable(self, now: float) -> int:
        if not self.queue:
            return 0
        return free_slots([EndpointSnapshot(e.url, True, e.blocks.usage, len(e.waiting),
                                            len(e.running) + len(e.admitted), 0.0, 0, e.shape.max_num_seqs)
                           for e in self.engines])

    def scrape(self, now: float) -> None:
        pass
