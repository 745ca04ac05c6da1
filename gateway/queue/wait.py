"""How long a request would wait in the fleet queue, and the Retry-After the gateway gives when it will not wait.

The fleet's drain rate is how fast the queue released entries lately: over its last DRAIN_SAMPLE releases within
DRAIN_WINDOW_S seconds (fleet-wide in Redis, each release's time kept to the millisecond by the release script; this
replica's own releases while Redis is down), the releases after the oldest one divided by the time since it. The
oldest counts as the start: the room it took opened before it, so counting it would quote a rate the fleet never ran
at, and so would rounding its time down to a whole second. While the queue is not empty every new request queues, so
that rate is the fleet's throughput for queued work. A request with `ahead` entries before it is released after about
(ahead + 1) / rate seconds; one that cannot be released by its deadline is answered at once instead of being held
until the deadline passes. Too few releases to measure a rate (a queue that just formed): no estimate, and nobody is
refused on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

DRAIN_WINDOW_S = 10
DRAIN_SAMPLE = 64  # the most recent releases the rate is measured over (fewer in the window: those)
MIN_RELEASES = 3  # fewer in the window: no rate (never refuse a request on no data)
RETRY_AFTER_LIMITS_S = (1, 3600)
UNKNOWN_RETRY_AFTER_S = 5  # a Retry-After when no rate is known


def drain_rate(release_times_s: Iterable[float], now_s: float) -> float | None:
    """Releases per second from the times of recent releases (in seconds, any order): those within the window after
    the oldest of them, over the time since it; None with fewer than MIN_RELEASES, or all at one instant."""
    times = [t for t in release_times_s if t > now_s - DRAIN_WINDOW_S]  # another replica's clock may run ahead
    if len(times) < MIN_RELEASES:
        return None
    first = min(times)
    after, span = sum(t > first for t in times), now_s - first
    return after / span if after and span > 0 else None


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
