"""This replica's per-class counts for the operator (arrivals, prompt tokens, answers, output tokens, sheds, time to
first token), kept in process and added into the fleet's Redis slots about once a second in one pipeline
(kvfleet/fleet/slo_stats.py: the layout, the reader). A request's path only adds to a dict; while Redis is
unreachable the counts are dropped (logged once), never retried on a request's time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvfleet.fleet import redis_keys
from kvfleet.fleet import slo_stats as stats
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.limits.usage import Usage

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0


class SloCounts:
    """Counts by (slot, field) since the last flush; counts nothing without a Redis client (nobody would read them)."""

    def __init__(self, client: Redis | None, fleet: str, clock: Callable[[], float] = time.time):
        self.client, self.fleet, self._clock = client, fleet, clock
        self.pending: Counter[tuple[int, str]] = Counter()
        self._failing = False

    def _add(self, priority: Priority, counter: str, amount: int = 1) -> None:
        if self.client is not None and amount:
            self.pending[(stats.slot_start(self._clock()), stats.field(priority, counter))] += amount

    def arrived(self, priority: Priority, prompt_tokens: int) -> None:
        """A request past validation and its key's rate limit, whatever becomes of it."""
        self._add(priority, stats.ARRIVALS)
        self._add(priority, stats.PROMPT_TOKENS, prompt_tokens)

    def shed(self, priority: Priority) -> None:
        """Refused without reaching an engine for want of room (shedding, a full queue, its deadline)."""
        self._add(priority, stats.SHED)

    def answered(self, priority: Priority, arrived_at: float, usage: Usage) -> None:
        """An engine's answer ended (Settlement.when_answered); it counts as completed once a token came, with its
        time to first token from `arrived_at` (time.monotonic() when the request reached the gateway) and its
        completion tokens (the engine's count, else one per streamed event)."""
        if usage.first_token_at is None:
            return
        self._add(priority, stats.COMPLETED)
        output = usage.completion if usage.completion is not None else usage.streamed_events or 0
        self._add(priority, stats.OUTPUT_TOKENS, output)
        self._add(priority, stats.ttft_bucket(max(0.0, usage.first_token_at - arrived_at)))

    async def flush(self) -> None:
        """Adds the pending counts into Redis in one pipeline; dropped if Redis is unreachable."""
        if not self.pending or self.client is None:
            return
        pending, self.pending = self.pending, Counter()
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for slot in sorted({slot for slot, _ in pending}):
                    key = redis_keys.slo_slot_key(self.fleet, slot)
                    for (s, name), amount in pending.items():
                        if s == slot:
                            pipe.hincrby(key, name, amount)
                    pipe.expire(key, stats.STATS_TTL_S)
                await pipe.execute()
        except (RedisError, OSError) as err:
            if not self._failing:
                log.warning("per-class SLO counts not written to Redis (%s); dropping them until it answers",
                            type(err).__name__)
            self._failing = True
            return
        if self._failing:
            log.info("per-class SLO counts written to Redis again")
        self._failing = False

    async def flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self.flush()
