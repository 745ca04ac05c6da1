"""What a prompt's prefix is worth on each engine: the precise index where an engine streams its KV events and the
gateway can tokenize, today's approximate character table elsewhere, and this replica's own recent dispatches.

The recent layer covers the moment between sending a request and its engine's events: without it, a burst of one
tenant's requests would spread over the fleet before the first one's prefix is reported stored (herding).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvfleet.gateway.prefix.approximate import ApproximatePrefixTable, prompt_text
from kvfleet.gateway.prefix.kv_index import KVIndex, chain_keys
from kvfleet.gateway.token_estimate import prompt_tokens

# (path, parsed body) -> the prompt's token ids as the engines will see them, or None when it cannot say
Tokenize = Callable[[str, dict], "list[int] | None"]
DEFAULT_BLOCK_SIZE = 16  # for the recent layer before any engine has reported its block size
RECENT_TTL_S = 3.0  # how long a dispatch counts before the engine's own events must say it


@dataclass(frozen=True)
class PromptKeys:
    approx: list[bytes]  # chained hashes of the prompt's leading characters (gateway/prefix/approximate.py)
    num_tokens: int = 0  # 0: not tokenized
    est_tokens: int = 0  # the prompt's length in tokens: num_tokens, or a guess from its characters
    precise: Mapping[int, list[bytes]] = field(default_factory=dict)  # block size -> chained token-block keys
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)


class RecentDispatches:
    """What this replica sent where in the last ttl seconds, keyed like the precise index."""

    def __init__(self, ttl_s: float = RECENT_TTL_S, capacity: int = 100_000) -> None:
        self.ttl_s, self.capacity = ttl_s, capacity
        self._sent: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def record(self, keys: list[bytes], url: str, now: float) -> None:
        for key in keys:
            self._sent[key] = (url, now)
            self._sent.move_to_end(key)
        while len(self._sent) > self.capacity:
            self._sent.popitem(last=False)

    def matched_blocks(self, keys: list[bytes], now: float) -> tuple[str | None, int]:
        owner, count = None, 0
        for key in keys:
            sent = self._sent.get(key)
            if sent is None or now - sent[1] > self.ttl_s or (owner is not None and sent[0] != owner):
                break
            owner, count = sent[0], count + 1
        return owner, count

    def forget(self, url: str) -> None:
        for key in [k for k, (u, _) in self._sent.items() if u == url]:
            del self._sent[key]


class PrefixRouting:
    def __init__(self, tokenize: Tokenize | None = None, index: KVIndex | None = None,
                 approx: ApproximatePrefixTable | None = None, recent: RecentDispatches | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenize = tokenize
        self.index = index or KVIndex()
        self.approx = approx or ApproximatePrefixTable()
        self.recent = recent or RecentDispatches()
        self.clock = clock

    @property
    def precise(self) -> bool:
        """Whether any engine's prefix is known from its events (and prompts can be tokenized to look it up)."""
        return self.tokenize is not None and bool(self.index.engines())

    def keys(self, path: str, body: dict, adapter: str | None = None) -> PromptKeys:
        """An adapter's request is keyed apart: its approximate chain starts from the adapter's name, and the
        engines' events (which name only the base model's blocks) are not looked up for it."""
        text = prompt_text(body)
        guess = sum(prompt_tokens(body))  # for a prompt it does not tokenize (gateway/token_estimate.py)
        if adapter is not None:
            return PromptKeys(self.approx.block_hashes(text, adapter), est_tokens=guess, adapter=adapter)
        approx = self.approx.block_hashes(text)
        if not self.precise:
            return PromptKeys(approx, est_tokens=guess)
        token_ids = self.tokenize(path, body)
        if not token_ids:
            return PromptKeys(approx, est_tokens=guess)
        sizes = set(self.index.block_sizes.values()) or {DEFAULT_BLOCK_SIZE}
        # an engine computes at least the prompt's last token: it caches at most (n - 1) // size full blocks
        precise = {size: chain_keys(token_ids[:(len(token_ids) - 1) // size * size], size) for size in sizes}
        return PromptKeys(approx, num_tokens=len(token_ids), est_tokens=len(token_ids), precise=precise)

    def uncached_tokens(self, keys: PromptKeys, url: str) -> int:
        """The prompt tokens the engine likely has to compute for it."""
        return round(keys.est_tokens * (1.0 - self.matches(keys).get(url, 0.0)))

    def matches(self, keys: PromptKeys) -> dict[str, float]:
        """For each engine, the share of the prompt it likely holds in its prefix cache."""
        out = self.approx.matches(keys.approx)
        if not keys.precise:
            return out
        for url in self.index.engines():  # engines with a live event stream: the index, not the guess
            out.pop(url, None)
        for url, blocks in self.index.matched_blocks(keys.precise).items():
            out[url] = blocks * self.index.block_sizes[url] / keys.num_tokens
        size, recent_keys = next(iter(keys.precise.items()))
        url, blocks = self.recent.matched_blocks(recent_keys, self.clock())
        if url is not None:
            out[url] = max(out.get(url, 0.0), blocks * size / keys.num_tokens)
        return out

    def reason(self, matches: Mapping[str, float], url: str) -> str:
        """What decided a choice, for kvfleet_gateway_routing_decisions_total."""
        share = matches.get(url, 0.0)
        if share <= 0.0 or share < max(matches.values()):
            return "load"
        return "prefix_precise" if url in self.index.engines() and self.tokenize is not None else "prefix_approximate"

    def record(self, keys: PromptKeys, url: str) -> None:
        """The request went to url."""
        self.approx.record(keys.approx, url)
        if keys.precise:
            self.recent.record(next(iter(keys.precise.values())), url, self.clock())

    def forget(self, url: str) -> None:
        """An engine left the pool; its cache went with it."""
        self.approx.forget(url)
        self.index.forget(url)
        self.recent.forget(url)
