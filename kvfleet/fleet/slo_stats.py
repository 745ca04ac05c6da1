"""What the gateways count of each priority class in Redis, and the operator's reader of it (ClassWindow, slo.py).

Every gateway replica counts in process and adds its counts once a second (gateway/slo_counts.py) into one Redis
hash per SLOT_S-second slot and fleet (redis_keys.slo_slot_key), fields `<class>:<counter>`; replicas add into
the same hashes, so a slot holds the whole fleet's counts. Each hash expires STATS_TTL_S after its last write.

A window is the slots that overlap the last `window_s` seconds, the current (partial) one included, so it covers
from the oldest slot's start to now: slightly more than asked (less than SLOT_S more), and the ClassWindow says how
much. The last second or so is not there yet (the replicas' flush interval).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping

from kvfleet.fleet import redis_keys
from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import DEFAULT_SLO_CLASSES, ClassWindow

log = logging.getLogger(__name__)

SLOT_S = 5  # seconds per slot: whole seconds, so a slot's key names its start second
STATS_TTL_S = 900  # a slot's hash expires this long after its last write: nothing stays
# TTFT histogram bounds (seconds): finer than the gateway's LATENCY_BUCKETS between 0.1 and 10 s, where objectives
# lie, and holding each default objective as a bound, so attainment against them is exact, not interpolated.
TTFT_BUCKETS: tuple[float, ...] = tuple(sorted({0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                                                15.0, 30.0, 60.0, *(c.ttft_s for c in DEFAULT_SLO_CLASSES.values())}))

# The counters of one class in a slot (the histogram's fields are TTFT_PREFIX + the bucket's upper bound).
ARRIVALS, PROMPT_TOKENS, COMPLETED, OUTPUT_TOKENS, SHED = "arrivals", "prompt_tokens", "completed", "output_tokens", \
    "shed"
COUNTERS = (ARRIVALS, PROMPT_TOKENS, COMPLETED, OUTPUT_TOKENS, SHED)
TTFT_PREFIX = "ttft_le:"


def slot_start(t: float) -> int:
    """The start second (Unix time) of the slot holding wall-clock time `t`."""
    return int(math.floor(t / SLOT_S)) * SLOT_S


def window_slots(now: float, window_s: float) -> tuple[list[int], float]:
    """The start seconds of the slots overlapping (now - window_s, now], oldest first, and the seconds they cover up
    to now. A window is at most what the slots' TTL keeps."""
    window_s = min(max(window_s, 0.0), STATS_TTL_S - SLOT_S)
    first, last = slot_start(now - window_s), slot_start(now)
    return list(range(first, last + 1, SLOT_S)), now - first


def ttft_bucket(seconds: float) -> str:
    """The histogram field one answer's time to first token falls in (its bucket's upper bound, `inf` past the
    last)."""
    for bound in TTFT_BUCKETS:
        if seconds <= bound:
            return f"{TTFT_PREFIX}{bound:g}"
    return f"{TTFT_PREFIX}inf"


def field(priority: Priority, counter: str) -> str:
    return f"{priority.value}:{counter}"


def decode_class_windows(slots: Iterable[Mapping[bytes | str, bytes | str | int]], window_s: float,
                         queued: Mapping[bytes | str, bytes | str | int] | None = None) -> dict[Priority, ClassWindow]:
    """The per-class windows from the slots' hashes (summed) and the queue's per-class counts; fields of unknown
    classes or counters, and values that are not integers, are ignored. The histogram's bounds are read from the
    fields, so slots written with other bounds still add up (each count under its own bound)."""
    sums: dict[Priority, dict[str, int]] = {p: {} for p in Priority}
    buckets: dict[Priority, dict[float, int]] = {p: {} for p in Priority}
    for slot in slots:
        for raw_name, raw_value in slot.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
            value = _integer(raw_value)
            cls, _, counter = name.partition(":")
            if value is None or cls not in Priority._value2member_map_:
                continue
            priority = Priority(cls)
            if counter in COUNTERS:
                sums[priority][counter] = sums[priority].get(counter, 0) + value
            elif counter.startswith(TTFT_PREFIX):
                try:
                    bound = float(counter[len(TTFT_PREFIX):])
                except ValueError:
                    continue
                buckets[priority][bound] = buckets[priority].get(bound, 0) + value
    waiting = {p: _integer((queued or {}).get(p.value, (queued or {}).get(p.value.encode(), 0))) or 0
               for p in Priority}
    return {p: ClassWindow(window_s, **sums[p], ttft_buckets=cumulative(buckets[p]), queued=waiting[p])
            for p in Priority}


def cumulative(counts: Mapping[float, int]) -> tuple[tuple[float, int], ...]:
    """Per-bucket counts as a Prometheus histogram's cumulative (bound, count) pairs, the last bound inf."""
    total, out = 0, []
    for bound in sorted(counts):
        total += counts[bound]
        out.append((bound, total))
    if not out or not math.isinf(out[-1][0]):
        out.append((math.inf, total))
    return tuple(out)


def _integer(value: object) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


async def read_class_windows(redis_url: str | None, fleet: str, window_s: float,
                             now: float | None = None) -> dict[Priority, ClassWindow]:
    """What the fleet's gateways counted of each class over the last `window_s` seconds (see the module's note on
    what a window covers), with each class's requests queued now; {} without a Redis URL or when Redis is
    unreachable (logged)."""
    if not redis_url:
        return {}
    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    starts, covered = window_slots(time.time() if now is None else now, window_s)
    client = Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for start in starts:
                pipe.hgetall(redis_keys.slo_slot_key(fleet, start))
            pipe.hgetall(redis_keys.queue_classes_key(fleet))
            *slots, queued = await pipe.execute()
    except (RedisError, OSError) as err:
        log.warning("per-class SLO counts unreadable from Redis for fleet %s: %s", fleet, err)
        return {}
    finally:
        await client.aclose()
    return decode_class_windows(slots, covered, queued)
