"""Per-key requests- and tokens-per-minute limits, shared by the gateway replicas through Redis.

The policy is a sliding window log at one-second resolution: each key counts admitted requests and tokens per
second, and a request is admitted while the last 60 seconds hold fewer than `rpm` requests and fewer than `tpm`
tokens. Tokens are reserved at admission (the request's estimated cost, in the same atomic step as the check) and
settled at the end with the real count, so a concurrent burst overshoots `tpm` by at most one reservation.
Unlike a fixed window it never lets 2x the limit through across a minute boundary, and unlike a per-request log
its cost is bounded (at most 60 counters per kind). Timestamps come from the gateways' clocks.

Redis: one hash per key (kvfleet.fleet.redis_keys.rate_limit_key), fields `r:<unix second>` and `t:<unix second>`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvfleet.fleet.redis_keys import rate_limit_key
from kvfleet.gateway.limits.keys import KeyInfo

log = logging.getLogger(__name__)

WINDOW_S = 60
REDIS_PROBE_INTERVAL_S = 1.0
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, asyncio.TimeoutError)

T = TypeVar("T")
Buckets = Mapping[int, int]  # unix second -> requests (or tokens) counted in that second


@dataclass(frozen=True)
class Reservation:
    """Tokens an admitted request holds in its key's window (bucket `second`) until it is settled."""

    key: KeyInfo
    tokens: int
    second: int
    local: bool  # made in this process's fallback, so it is settled there


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: Literal["rpm", "tpm"] | None = None
    retry_after_s: int = 0
    reservation: Reservation | None = field(default=None, compare=False)


def window_total(buckets: Buckets, now: float) -> int:
    """What the buckets of the last WINDOW_S seconds hold."""
    oldest = math.floor(now) - WINDOW_S
    return sum(n for second, n in buckets.items() if second > oldest)


def seconds_until_below(buckets: Buckets, limit: int, now: float) -> int:
    """For a window at or over `limit`: whole seconds (1 to WINDOW_S) until enough of its oldest buckets leave it."""
    remaining = window_total(buckets, now)
    oldest = math.floor(now) - WINDOW_S
    for second in sorted(s for s in buckets if s > oldest):
        remaining -= buckets[second]
        if remaining < limit:  # this bucket leaves the window at its second + WINDOW_S
            return min(WINDOW_S, max(1, math.ceil(second + WINDOW_S - now)))
    return WINDOW_S  # a limit of 0: the window never has room


def decide(requests: Buckets, tokens: Buckets, rpm: int | None, tpm: int | None, now: float) -> Verdict:
    """Admit while the window holds fewer than rpm requests and fewer than tpm tokens; else the longer wait."""
    refusals: list[tuple[int, Literal["rpm", "tpm"]]] = []
    if rpm is not None and window_total(requests, now) >= rpm:
        refusals.append((seconds_until_below(requests, rpm, now), "rpm"))
    if tpm is not None and window_total(tokens, now) >= tpm:
        refusals.append((seconds_until_below(tokens, tpm, now), "tpm"))
    if not refusals:
        return Verdict(allowed=True)
    wait, reason = max(refusals)
    return Verdict(allowed=False, reason=reason, retry_after_s=wait)


@dataclass
class _KeyWindows:
    requests: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)

    def prune(self, now: float) -> None:
        oldest = math.floor(now) - WINDOW_S
        for buckets in (self.requests, self.tokens):
            for second in [s for s in buckets if s <= oldest]:
                del buckets[second]


class LocalRateLimiter:
    """The same policy in this process's memory: the fallback while Redis is unreachable."""

    def __init__(self) -> None:
        self._keys: dict[str, _KeyWindows] = {}
        self._next_sweep = 0.0

    def admit(self, key: KeyInfo, now: float, tokens: int = 0) -> Verdict:
        windows = self._windows(key, now)
        verdict = decide(windows.requests, windows.tokens, key.rpm, key.tpm, now)
        if not verdict.allowed:
            return verdict
        second = math.floor(now)
        if key.rpm is not None:
            windows.requests[second] = windows.requests.get(second, 0) + 1
        if key.tpm is None or tokens <= 0:
            return verdict
        windows.tokens[second] = windows.tokens.get(second, 0) + tokens
        return Verdict(allowed=True, reservation=Reservation(key, tokens, second, local=True))

    def record_tokens(self, key: KeyInfo, n: int, now: float) -> None:
        windows = self._windows(key, now)
        second = math.floor(now)
        windows.tokens[second] = windows.tokens.get(second, 0) + n

    def settle(self, reservation: Reservation, actual: int, now: float) -> None:
        """Replaces the reservation with the real count, in its own bucket while that is still in the window."""
        delta = actual - reservation.tokens
        windows = self._windows(reservation.key, now)
        if reservation.second > math.floor(now) - WINDOW_S:
            left = windows.tokens.get(reservation.second, 0) + delta
            if left > 0:
                windows.tokens[reservation.second] = left
            else:
                windows.tokens.pop(reservation.second, None)
        elif delta > 0:  # the reservation already left the window; only a shortfall is still owed
            self.record_tokens(reservation.key, delta, now)

    def _windows(self, key: KeyInfo, now: float) -> _KeyWindows:
        if now >= self._next_sweep:  # forget idle keys once a window, so memory stays bounded
            self._next_sweep = now + WINDOW_S
            for windows in self._keys.values():
                windows.prune(now)
            self._keys = {k: w for k, w in self._keys.items() if w.requests or w.tokens}
        windows = self._keys.setdefault(key.key_id, _KeyWindows())
        windows.prune(now)
        return windows


# Reads the key's window, counts the request and reserves its tokens in one step; the same rule as `decide`.
# KEYS[1]: the key's hash. ARGV: now (unix second), rpm, tpm (-1: no limit), window seconds, tokens to reserve.
# Returns the request and token buckets as they were before this request: {second, n, second, n, ...} each.
ADMIT_SCRIPT = """
local now, rpm, tpm, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local reserve = tonumber(ARGV[5])
local fields = redis.call('HGETALL', KEYS[1])
local requests, tokens, request_total, token_total = {}, {}, 0, 0
for i = 1, #fields, 2 do
  local second, n = tonumber(string.sub(fields[i], 3)), tonumber(fields[i + 1])
  if second <= now - window then
    redis.call('HDEL', KEYS[1], fields[i])
  elseif string.sub(fields[i], 1, 1) == 'r' then
    request_total = request_total + n
    table.insert(requests, second)
    table.insert(requests, n)
  else
    token_total = token_total + n
    table.insert(tokens, second)
    table.insert(tokens, n)
  end
end
local allowed = (rpm < 0 or request_total < rpm) and (tpm < 0 or token_total < tpm)
if allowed and rpm >= 0 then
  redis.call('HINCRBY', KEYS[1], 'r:' .. now, 1)
end
if allowed and tpm >= 0 and reserve > 0 then
  redis.call('HINCRBY', KEYS[1], 't:' .. now, reserve)
end
if allowed then
  redis.call('EXPIRE', KEYS[1], window + 1)
end
return {requests, tokens}
"""

# Settles a reservation: adds (real - reserved) to the reservation's bucket while it is in the window, dropping
# a bucket that reaches 0; a reservation that already left the window only adds a shortfall, to the current second.
# KEYS[1]: the key's hash. ARGV: now (unix second), the reservation's second, real - reserved, window seconds.
SETTLE_SCRIPT = """
local now, second, delta, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if second > now - window then
  if redis.call('HINCRBY', KEYS[1], 't:' .. second, delta) <= 0 then
    redis.call('HDEL', KEYS[1], 't:' .. second)
  end
elseif delta > 0 then
  redis.call('HINCRBY', KEYS[1], 't:' .. now, delta)
else
  return 0
end
redis.call('EXPIRE', KEYS[1], window + 1)
return 1
"""


class RateLimiter:
    """Per-key rpm/tpm limits in Redis, falling back to a `LocalRateLimiter` while Redis is unreachable.

    While degraded it tries Redis again at most once per REDIS_PROBE_INTERVAL_S; each Redis call is bounded by
    `timeout_s`, so a black-holed Redis delays a request by at most that much.
    """

    def __init__(self, redis_client: Redis, fleet: str, *, timeout_s: float = 0.5):
        self.redis = redis_client
        self.fleet = fleet
        self.timeout_s = timeout_s
        self.local = LocalRateLimiter()
        self.degraded = False
        self._next_probe = 0.0
        self._admit_script = redis_client.register_script(ADMIT_SCRIPT)
        self._settle_script = redis_client.register_script(SETTLE_SCRIPT)

    def redis_key(self, key: KeyInfo) -> str:
        return rate_limit_key(self.fleet, key.key_id)

    async def admit(self, key: KeyInfo, tokens: int = 0, now: float | None = None) -> Verdict:
        """Whether this request may go on now; if so it counts against rpm and reserves `tokens` against tpm."""
        if key.rpm is None and key.tpm is None:
            return Verdict(allowed=True)
        now = time.time() if now is None else now
        if not self._should_try_redis():
            return self.local.admit(key, now, tokens)
        second = math.floor(now)
        args = [second, _or_minus_one(key.rpm), _or_minus_one(key.tpm), WINDOW_S, max(0, tokens)]
        try:
            requests, buckets = await self._call(self._admit_script(keys=[self.redis_key(key)], args=args))
        except UNREACHABLE as err:
            self._mark_unreachable(err)
            return self.local.admit(key, now, tokens)
        self._mark_reachable()
        verdict = decide(_pairs(requests), _pairs(buckets), key.rpm, key.tpm, now)
        if not verdict.allowed or key.tpm is None or tokens <= 0:
            return verdict
        return Verdict(allowed=True, reservation=Reservation(key, tokens, second, local=False))

    async def settle(self, reservation: Reservation, actual: int, now: float | None = None) -> None:
        """Replaces a reservation with the tokens the request really used (0 refunds it)."""
        if actual < 0:
            raise ValueError(f"token count must be non-negative, got {actual}")
        now = time.time() if now is None else now
        if actual == reservation.tokens:
            return
        if reservation.local:
            self.local.settle(reservation, actual, now)
            return
        args = [math.floor(now), reservation.second, actual - reservation.tokens, WINDOW_S]
        try:
            await self._call(self._settle_script(keys=[self.redis_key(reservation.key)], args=args))
        except UNREACHABLE as err:
            # The reservation stays in Redis until it leaves the window (the safe side); a shortfall counts here.
            self._mark_unreachable(err)
            if actual > reservation.tokens:
                self.local.record_tokens(reservation.key, actual - reservation.tokens, now)
            return
        self._mark_reachable()

    async def _call(self, awaitable: Awaitable[T]) -> T:
        async with asyncio.timeout(self.timeout_s):
            return await awaitable

    def _should_try_redis(self) -> bool:
        if not self.degraded:
            return True
        if time.monotonic() < self._next_probe:
            return False
        self._next_probe = time.monotonic() + REDIS_PROBE_INTERVAL_S  # one probe per interval, not one per caller
        return True

    def _mark_unreachable(self, err: BaseException) -> None:
        self._next_probe = time.monotonic() + REDIS_PROBE_INTERVAL_S
        if not self.degraded:
            self.degraded = True
            log.warning("Redis is unreachable (%s); rate limits are enforced per gateway replica until it is back",
                        err or type(err).__name__)

    def _mark_reachable(self) -> None:
        if self.degraded:
            self.degraded = False
            log.info("Redis is reachable again; rate limits are shared across replicas again")


def _or_minus_one(limit: int | None) -> int:
    return -1 if limit is None else limit


def _pairs(flat: list) -> dict[int, int]:
    return {int(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}


class InProcessRateLimiter:
    """The same limits for a gateway run without Redis (one replica)."""

    degraded = False

    def __init__(self) -> None:
        self.local = LocalRateLimiter()

    async def admit(self, key: KeyInfo, tokens: int = 0, now: float | None = None) -> Verdict:
        if key.rpm is None and key.tpm is None:
            return Verdict(allowed=True)
        return self.local.admit(key, time.time() if now is None else now, tokens)

    async def settle(self, reservation: Reservation, actual: int, now: float | None = None) -> None:
        if actual != reservation.tokens:
            self.local.settle(reservation, actual, time.time() if now is None else now)
