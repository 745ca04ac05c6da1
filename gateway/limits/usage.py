"""Token accounting for the tokens-per-minute limit: what a request reserves, and what its answer really used.

At admission a request reserves its estimate (gateway/token_estimate.py: prompt + output allowance x choices); at its
end the reservation is settled
with the engine's own count (`usage.total_tokens`, prompt plus every choice's completion). Streams get that count
from the engine's usage chunk, which the gateway asks for (`stream_options.include_usage`) and removes again
when the client did not ask for it, so the client's stream is unchanged.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.gateway.token_estimate import Cost

EVENT_END = re.compile(rb"\r?\n\r?\n")
MAX_PENDING_BYTES = 1 << 20  # a partial SSE event longer than this is passed on without waiting for its end


@dataclass(frozen=True)
class Usage:
    """What an answer used: the engine's total, or None when it carried none (a stream cut short)."""

    total: int | None
    streamed_events: int | None = 0  # events seen: the fallback estimate of generated tokens; None: unknown
    # For the per-class counts (slo_counts.py), outside equality: the reservation's accounting is total and events.
    completion: int | None = field(default=None, compare=False)  # the engine's completion tokens, when it said
    # time.monotonic() of the answer's first token: a stream's first token event, an unstreamed answer's arrival
    # (its first token is not visible before the whole answer); None: no token came (an error, nothing relayed)
    first_token_at: float | None = field(default=None, compare=False)


def ask_stream_usage(body: dict) -> bool:
    """Asks the engine for the usage chunk of a stream; True when the gateway added it (so it must hide it)."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if options is None:
        body["stream_options"] = {"include_usage": True}
        return True
    if isinstance(options, dict) and (options.get("include_usage") is None or options["include_usage"] is False):
        options["include_usage"] = True
        return True
    return False  # the client asked for it already, or sent something the schema refuses


def answer_usage(status: int, content: bytes, received_at: float | None = None) -> Usage:
    """An unstreamed answer's usage: 0 for an error (nothing generated); unknown when a success carries none.
    `received_at`: when the answer arrived, its first token's time as far as the gateway can see."""
    if not 200 <= status < 300:
        return Usage(0)
    try:
        usage = json.loads(content).get("usage", {})
        total, completion = usage.get("total_tokens"), usage.get("completion_tokens")
    except (ValueError, AttributeError):
        total = completion = None
    completion = completion if _count(completion) else None
    if _count(total):
        return Usage(total, completion=completion, first_token_at=received_at)
    return Usage(None, streamed_events=None, completion=completion, first_token_at=received_at)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class StreamUsageMeter:
    """Reads an SSE stream as it is relayed: notes the usage chunk's total, and drops that chunk if told to."""

    def __init__(self, hide_usage: bool):
        self.hide_usage = hide_usage
        self.total: int | None = None
        self.completion: int | None = None
        self.events = 0
        self.first_token_at: float | None = None
        self._pending = b""

    @property
    def usage(self) -> Usage:
        return Usage(self.total, self.events, self.completion, self.first_token_at)

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to pass on now: the complete events in `chunk` and before it, the usage chunk left out."""
        data = self._pending + chunk
        out, start = [], 0
        for end in EVENT_END.finditer(data):
            event = data[start:end.end()]
            start = end.end()
            if not self._read(event):
                out.append(event)
        self._pending = data[start:]
        if len(self._pending) > MAX_PENDING_BYTES:  # not SSE as we know it: pass it on rather than hold it
            out.append(self._pending)
            self._pending = b""
        return b"".join(out)

    def finish(self) -> bytes:
        """Whatever is left when the stream ends (an event without its blank line)."""
        rest, self._pending = self._pending, b""
        return b"" if rest and self._read(rest) else rest

    def _read(self, event: bytes) -> bool:
        """Counts one event; True when it is a usage-only chunk to drop."""
        if not event.startswith(b"data: {"):
            return False
        if self.first_token_at is None and is_token_event(event):
            self.first_token_at = time.monotonic()
        if b'"usage"' not in event:
            self.events += 1
            return False
        try:
            chunk = json.loads(event[len(b"data: "):])
        except ValueError:
            self.events += 1
            return False
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
            self.total = total  # the last one wins (continuous usage stats are cumulative)
            completion = usage.get("completion_tokens")
            self.completion = completion if _count(completion) else self.completion
        else:
            self.events += 1
        return self.hide_usage and total is not None and chunk.get("choices") == []


def is_token_event(event: bytes) -> bool:
    """Whether an SSE event carries the answer's first token: a chunk with choices, not the role announcement
    an engine sends before generating (`"delta": {"role": "assistant", ...}`), nor an error or usage-only chunk."""
    return (event.startswith(b"data: {") and b'"choices"' in event and b'"role"' not in event
            and b'"choices":[]' not in event.replace(b" ", b""))


class Settlement:
    """One request's reservation, settled exactly once: with the real count, or refunded when nothing ran.

    The proxy calls it with the answer's `Usage`; `hide_stream_usage` tells it to drop the usage chunk it relays.
    """

    def __init__(self, cost: Cost, settle: Callable[[int], None], hide_stream_usage: bool = False):
        self.cost = cost
        self.hide_stream_usage = hide_stream_usage
        self._settle = settle
        self.settled: int | None = None
        self._when_finished: list[Callable[[], None]] = []
        self._when_answered: list[Callable[[Usage], None]] = []

    def when_finished(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once the request has ended (settled, refunded or abandoned), at once if it has."""
        if self.settled is None:
            self._when_finished.append(callback)
        else:
            callback()

    def when_answered(self, callback: Callable[[Usage], None]) -> None:
        """Calls `callback` with the answer's Usage when an answer settles it (not when refunded or abandoned)."""
        self._when_answered.append(callback)

    def __call__(self, usage: Usage) -> None:
        if self.settled is None:
            for callback in self._when_answered:
                callback(usage)
        if usage.total is not None:
            self._finish(usage.total)
        elif usage.streamed_events is None:  # a success without a count: keep the whole reservation
            self._finish(self.cost.tokens)
        else:  # a stream cut short: the prompt estimate and one token per streamed event
            self._finish(self.cost.prompt + min(usage.streamed_events, self.cost.completion))

    def abandoned(self) -> None:
        """The client left while the engine worked on it: the whole reservation stays (no count comes back)."""
        self._finish(self.cost.tokens)

    def refund(self) -> None:
        """Nothing was generated (refused, shed, failed before an answer); a no-op once settled."""
        self._finish(0)

    def _finish(self, actual: int) -> None:
        if self.settled is None:
            self.settled = actual
            self._settle(actual)
            for callback in self._when_finished:
                callback()
