"""How long a request would wait in the fleet queue, and the Retry-After the gateway gives when it will not wait.

The fleet's drain rate is how fast the queue released entries while it held some. Each release keeps, to the
millisecond, when its entry was queued and when it was released (fleet-wide in Redis; this replica's own while Redis
is down), and the queue keeps when it last went from empty to holding an entry. The queue held entries over the union
of its entries' waits, and of the time since that start while it still holds some; in that time every request that
came queued, and one left each time the fleet had room, so the releases over that busy time are the fleet's
throughput for queued work. The time the queue was empty does not count: a queue that forms for a moment now and
then, while most requests go straight to an engine, releases a few entries in a long time, and a rate over all of
that time quoted a fleet serving 0.19/s that served 2/s (requests refused for deadlines they would have met). The
releases counted are those within DRAIN_WINDOW_S seconds, at most the last DRAIN_SAMPLE; with more in the window, the
oldest sampled release is the start, and does not count: the room it took opened before it.

A request with `ahead` entries before it is released after about (ahead + 1) / rate seconds; one that cannot be
released by its deadline is answered at once instead of being held until the deadline passes. Too few releases to
measure a rate (a queue that just formed): no estimate, and nobody is refused on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

DRAIN_WINDOW_S = 10
DRAIN_SAMPLE = 64  # the most recent releases the rate is measured over (fewer in the window: those)
MIN_RELEASES = 3  # fewer in the window: no rate (never refuse a request on no data)
RETRY_AFTER_LIMITS_S = (1, 3600)
UNKNOWN_RETRY_AFTER_S = 5  # a Retry-After when no rate is known


def drain_rate(releases: Iterable[tuple[float, float]], now_s: float,
               busy_since_s: float | None = None) -> float | None:
    """Releases per second of queued time, from recent releases as (queued, released) times in seconds, any order,
    and the start of the queue's busy period while it holds entries (None while it is empty): the releases within
    the window over the union of their waits and of that period, clipped to the window (module docstring). None
    with fewer than MIN_RELEASES, or no time queued."""
    window_start = now_s - DRAIN_WINDOW_S
    recent = sorted((released, queued) for queued, released in releases if released > window_start)
    if len(recent) < MIN_RELEASES:
        return None
    start = recent[0][0] if len(recent) >= DRAIN_SAMPLE else window_start
    # (a queued time after its release: replicas' clocks apart; it waited no time that counts)
    waits = [(min(max(queued, start), released), released) for released, queued in recent if released > start]
    if busy_since_s is not None:
        waits.append((max(busy_since_s, start), now_s))
    busy = _union_length(waits)
    counted = sum(released > start for released, _ in recent)
    return counted / busy if counted and busy > 0 else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for begin, end in sorted(intervals):
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


def max_ahead(rate: float | None, max_wait_ms: float) -> int | None:
    """The most entries that may go before a request for it still to be released within max_wait_ms; None without a
    rate. Never below 0: a request with nobody ahead waits for the next free slot, which no rate predicts."""
    if rate is None:
        return None
    return max(0, math.floor(rate * max_wait_ms / 1000.0) - 1)


def predicted_wait_s(ahead: int, rate: float | None) -> float | None:
    return None if rate is None else (ahead + 1) / rate


def retry_after_s(ahead: int, rate: float | None, max_wait_ms: float = 0.0) -> int:
    """When to come back: once the queue now ahead has drained to half of what a max_wait_ms deadline allows (all
    of it for a request that will not wait), if nothing else arrived; whole seconds, 1 to an hour."""
    wait = predicted_wait_s(ahead, rate)
    if wait is None:
        return UNKNOWN_RETRY_AFTER_S
    low, high = RETRY_AFTER_LIMITS_S
    return int(min(high, max(low, math.ceil(wait - max_wait_ms / 2000.0))))
