"""What an engine's answer says about the engine: the pure rule for retrying elsewhere and counting toward ejection.

Only the engine's own faults count against it (connection errors and timeouts are judged by the caller). A request
that makes an engine answer 4xx, or an unmarked 500, would fail the same way on any engine: retrying it there, or
ejecting engines for it, would let one client empty the fleet.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from kvfleet.fleet.headers import ENGINE_FAULT, FAULT

FAULT_HEADER = FAULT  # the engine sets it to ENGINE_FAULT on every 5xx that is its own fault
GATEWAY_STATUSES = (502, 504)  # a proxy between gateway and engine (a sidecar, a load balancer) lost the engine


class AnswerClass(Enum):
    OK = "ok"  # 2xx: relay it; the engine works
    BUSY = "busy"  # 429 / unmarked 503: full or draining; try another engine, never count it
    FAULT = "fault"  # the engine's own fault: try another engine before the first byte, count toward ejection
    REQUEST = "request"  # the request's fault (4xx, unmarked 5xx): return it unchanged, never retry or count


def classify(status: int, headers: Mapping[str, str]) -> AnswerClass:
    """The class of an engine's answer from its status and headers (header names lower-case, as httpx gives them)."""
    if status < 400:
        return AnswerClass.OK
    marked = headers.get(FAULT_HEADER, "").strip().lower() == ENGINE_FAULT
    if status >= 500 and marked or status in GATEWAY_STATUSES:
        return AnswerClass.FAULT
    if status in (429, 503):
        return AnswerClass.BUSY
    return AnswerClass.REQUEST
