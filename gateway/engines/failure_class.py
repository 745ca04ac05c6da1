"""What an engine's answer says about the engine: the pure rule for retrying elsewhere and counting toward ejection.

Only the engine's own faults count against it (connection errors and timeouts are judged by the caller). A request
that makes an engine answer 4xx, or an unmarked 500, would fail the same way on any engine: retrying it there, or
ejecting engines for it, would let one client empty the fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


# Envoy's response flags (access log RESPONSE_FLAGS) that say the engine failed the attempt: no connection (UF),
# the connection or stream ended or was reset by the engine's side (UC, UR), no answer or no progress in time
# (UT, SI), a malformed answer (UPE). The proxy's connection errors and timeouts, in Envoy's words.
ENGINE_FAILED_FLAGS = frozenset({"UF", "UC", "UR", "UT", "SI", "UPE"})
# Envoy answered itself without trying an engine: none healthy (UH), its own connection cap (UO), no route (NR).
NO_ENGINE_FLAGS = frozenset({"UH", "UO", "NR", "NC"})


def classify_attempt(status: int | None, flags: Iterable[str], headers: Mapping[str, str]) -> AnswerClass | None:
    """The class of one Envoy attempt at an engine, from its access log entry: the status the engine answered
    (0 or None: none), Envoy's response flags (short names) and the answer's headers (names lower-case).
    None: the attempt says nothing about the engine (the client left before an answer, or Envoy tried no engine:
    UH, UO, a local reset). A fault after the first byte (a stream reset midway) is still the engine's fault."""
    flags = frozenset(flags)
    if flags & ENGINE_FAILED_FLAGS:
        return AnswerClass.FAULT
    if not status or flags & NO_ENGINE_FLAGS:
        return None
    return classify(status, headers)


def engine_health(verdict: AnswerClass | None) -> bool | None:
    """What EndpointPool.record_done / record_outcome take: True works, False counts toward ejection, None neither
    (busy, the request's own fault, or nothing known)."""
    return {AnswerClass.OK: True, AnswerClass.FAULT: False}.get(verdict)
