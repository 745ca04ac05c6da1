"""Requests read from a log as a Trace: the CSV trace of `kvfleet bench autoscale` (t,prompt_tokens,output_tokens,
priority), or the engine's own request log (`kvfleet engine` lines, plain or `--log-format json`). A request's arrival
is its log line's time less its total_s; lines that are not finished requests are skipped; a failed request counts
its prompt (it arrived) and one output token."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime
from pathlib import Path

from kvfleet.autoscale_replay.trace import MAX_ROWS, MAX_TOKENS, Row, Trace, TraceError, parse_csv
from kvfleet.fleet.priority import Priority

MAX_LINE_BYTES = 1 << 16
_PLAIN_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:,\d+)?) ")
_FIELD = re.compile(r"\b(prompt_tokens|completion_tokens|total_s|priority)=([^\s]+)")


def read_requests(path: Path, max_rows: int = MAX_ROWS) -> Trace:
    """The requests in a request log or CSV trace; TraceError names the line and what to change."""
    try:
        raw = path.open("rb")
    except OSError as err:
        raise TraceError(f"{path}: cannot read it ({err.strerror or err}); give the path of a request log or a CSV "
                         "trace") from None
    with raw:
        stream = io.BufferedReader(raw)
        head = stream.peek(MAX_LINE_BYTES)[:MAX_LINE_BYTES].lstrip(b"\xef\xbb\xbf \t\r\n")
        if head.startswith(b"{") or b"prompt_tokens=" in head.split(b"\n", 1)[0] or _PLAIN_TIME.match(
                head[:40].decode("latin-1")):
            return _engine_log(stream, str(path), max_rows)
        return parse_csv(stream, str(path), max_rows)


def _engine_log(stream: io.BufferedReader, name: str, max_rows: int) -> Trace:
    arrivals: list[tuple[float, int, int, Priority]] = []
    line = 0
    while chunk := stream.readline(MAX_LINE_BYTES):
        line += 1
        if len(chunk) >= MAX_LINE_BYTES and not chunk.endswith(b"\n"):
            raise TraceError(f"{name} line {line}: longer than {MAX_LINE_BYTES:,} bytes; give the engine's request "
                             "log, one request per line")
        text = chunk.decode("utf-8", errors="replace").strip()
        request = _json_request(text) if text.startswith("{") else _plain_request(text)
        if request is None:
            continue
        if len(arrivals) >= max_rows:
            raise TraceError(f"{name} line {line}: more than {max_rows:,} requests; plan from a part of the log")
        arrivals.append(request)
    if not arrivals:
        raise TraceError(f"{name}: no finished requests in it; give the engine's request log (lines of the "
                         "`kvfleet.requests` logger, with prompt_tokens= and completion_tokens=) or a CSV trace "
                         "with the header t,prompt_tokens,output_tokens,priority")
    start = min(a[0] for a in arrivals)
    return Trace.of(Row(t - start, p, o, c) for t, p, o, c in arrivals)


def _json_request(text: str) -> tuple[float, int, int, Priority] | None:
    try:
        entry = json.loads(text)
        finished = datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError, TypeError):
        return None
    return _request(finished, entry) if isinstance(entry, dict) else None


def _plain_request(text: str) -> tuple[float, int, int, Priority] | None:
    when = _PLAIN_TIME.match(text)
    if when is None or "prompt_tokens=" not in text:
        return None
    try:
        finished = datetime.strptime(when.group(1).replace(",", "."), "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        try:
            finished = datetime.strptime(when.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        except ValueError:
            return None
    return _request(finished, dict(_FIELD.findall(text)))


def _request(finished: float, fields: dict) -> tuple[float, int, int, Priority] | None:
    """(arrival, prompt tokens, output tokens, class) of a finished request's fields; None when they are not one."""
    try:
        prompt, output = int(fields["prompt_tokens"]), int(fields.get("completion_tokens", 0))
        total = float(fields.get("total_s") or 0.0)
    except (KeyError, ValueError, TypeError):
        return None
    if not (1 <= prompt <= MAX_TOKENS and 0 <= output <= MAX_TOKENS and 0 <= total < 86_400):
        return None
    try:
        priority = Priority(str(fields.get("priority", "standard")).strip("'\"").lower())
    except ValueError:
        priority = Priority.STANDARD
    return finished - total, prompt, max(1, output), priority
