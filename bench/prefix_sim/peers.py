"""Peer routers as the simulation runs them, ported from their source: sglang-router's `cache_aware` policy
(sgl-router src/policies/cache_aware.rs, the same in smg), so the 2-engine runs on real processes can be repeated
here without the machine's noise and with many seeds.

Its decision, per request: when the load is imbalanced (the busiest worker's in-flight requests exceed the least
busy one's by more than `balance_abs` and by the factor `balance_rel`), the least busy worker; otherwise the worker
whose approximate tree matches the most of the prompt if that share exceeds `cache_threshold`, else the worker with
the smallest tree. The prompt is then inserted into the chosen worker's tree. The tree is the router's own guess:
it never hears of evictions (a periodic trim keeps it under max_tree_size, 64M characters by default: never reached
here). Here the tree is kept at block granularity over token ids, which is what a character radix tree reduces to for
prompts that differ only after their shared system prompt.
"""

from __future__ import annotations

import random
from collections import deque

from bench.prefix_sim.engine import Job, SimEngine

SGLANG = "sglang cache_aware"


class SGLangCacheAware:
    """One replica of sglang-router with its defaults (cache_threshold 0.3, balance 64 / 1.5)."""

    prefix = None  # the simulation's loop reads this to build request bodies: this router reads token ids itself

    def __init__(self, engines: list[SimEngine], seed: int, block_size: int, cache_threshold: float = 0.3,
                 balance_abs: int = 64, balance_rel: float = 1.5) -> None:
        self.engines, self.block_size, self.rng = engines, block_size, random.Random(seed)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.trees: list[set[int]] = [set() for _ in engines]  # chained block keys each worker was sent
        self.tree_tokens = [0] * len(engines)
        self.in_flight: list[list[Job]] = [[] for _ in engines]  # the router's own count: sent, not yet finished
        self.queue: deque[Job] = deque()  # never used: the router forwards every request at once

    def _keys(self, token_ids: tuple[int, ...]) -> list[int]:
        keys, parent = [], 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, token_ids[start:start + self.block_size]))
            keys.append(parent)
        return keys

    def _load(self, k: int) -> int:
        self.in_flight[k] = [job for job in self.in_flight[k] if job.finished is None]
        return len(self.in_flight[k])

    def route(self, job: Job, now: float, must: bool = False) -> int:
        tokens = job.arrival.token_ids
        keys = self._keys(tokens)
        loads = [self._load(k) for k in range(len(self.engines))]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > min(loads) * self.balance_rel:
            chosen = min(range(len(loads)), key=lambda k: (loads[k], self.rng.random()))
        else:
            matched = [self._matched(keys, k) for k in range(len(self.engines))]
            best = max(range(len(matched)), key=lambda k: (matched[k], self.rng.random()))
            if matched[best] * self.block_size / len(tokens) > self.cache_threshold:
                chosen = best
            else:
                chosen = min(range(len(self.engines)), key=lambda k: (self.tree_tokens[k], self.rng.random()))
        tree = self.trees[chosen]
        for key in keys:
            if key not in tree:
                tree.add(key)
                self.tree_tokens[chosen] += self.block_size
        self.tree_tokens[chosen] += len(tokens) % self.block_size  # the tail the tree keeps too
        self.in_flight[chosen].append(job)
        return chosen

    def _matched(self, keys: list[int], k: int) -> int:
        tree, n = self.trees[k], 0
        for key in keys:
            if key not in tree:
                break
            n += 1
        return n

    def releasable(self, now: float) -> int:
        return 0

    def scrape(self, now: float) -> None:
        pass
