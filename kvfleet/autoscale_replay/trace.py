"""A request trace: rows of (arrival second, prompt tokens, output tokens, priority class), read from and written
to CSV. Reading streams the file into four compact columns and stops at MAX_ROWS; every malformed row is a
TraceError naming the line and what to write there."""

from __future__ import annotations

import codecs
import csv
import io
import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvfleet.fleet.priority import PRIORITY_NAMES, Priority

if TYPE_CHECKING:
    from kvfleet.autoscale_replay.batch import BatchJob

COLUMNS = ("t", "prompt_tokens", "output_tokens", "priority")
CLASSES = tuple(p.value for p in Priority)  # in rank order: critical first
MAX_ROWS = 1_000_000
MAX_TIME_S = 7 * 86_400  # the simulation steps every second: a week is ~10 minutes per policy
MAX_TOKENS = 10_000_000
_FIELD_LIMIT = 1 << 16  # bytes in one cell: a longer one is not a number or a class


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line and what to change."""


@dataclass(frozen=True, slots=True)
class Row:
    t: float
    prompt_tokens: int
    output_tokens: int
    priority: Priority


@dataclass(frozen=True)
class Trace:
    """Rows sorted by arrival (ties keep their order in the file); the trace lasts until its last second with an
    arrival ends, or its last batch job's deadline when that is later."""

    rows: tuple[Row, ...]
    duration_s: int
    jobs: tuple[BatchJob, ...] = ()  # Batch API jobs created during the trace (autoscale_replay/batch.py)

    def with_jobs(self, jobs: Iterable[BatchJob]) -> Trace:
        added = tuple(sorted((*self.jobs, *jobs), key=lambda j: j.t))
        return Trace(self.rows, max([self.duration_s] + [math.ceil(j.deadline) for j in added]), added)

    @classmethod
    def of(cls, rows: Iterable[Row]) -> Trace:
        ordered = tuple(sorted(rows, key=lambda r: r.t))
        return cls(ordered, math.floor(ordered[-1].t) + 1 if ordered else 0)

    def count(self, priority: Priority) -> int:
        return sum(1 for r in self.rows if r.priority is priority)


def read_csv(path: Path, max_rows: int = MAX_ROWS) -> Trace:
    """The trace in a CSV file with a header row naming at least COLUMNS (others are ignored)."""
    try:
        raw = path.open("rb")
    except OSError as err:
        raise TraceError(f"{path}: cannot read it ({err.strerror or err}); give the path of a CSV file") from None
    with raw:
        return parse_csv(raw, str(path), max_rows)


def parse_csv(raw: io.RawIOBase | io.BufferedIOBase, name: str, max_rows: int = MAX_ROWS) -> Trace:
    """Rows from a byte stream: UTF-8 (a byte-order mark is allowed) or UTF-16 with its byte-order mark."""
    times, prompts, outputs, classes = array("d"), array("q"), array("q"), bytearray()
    for line, (t, prompt, output, priority) in csv_rows(raw, name, COLUMNS):
        if len(times) >= max_rows:
            raise TraceError(f"{name} line {line}: more than {max_rows:,} requests; replay a part of the trace "
                             "(split the file by time)")
        times.append(parse_time(t, name, line))
        prompts.append(parse_tokens(prompt, "prompt_tokens", name, line))
        outputs.append(parse_tokens(output, "output_tokens", name, line))
        classes.append(_class(priority, name, line))
    if not times:
        raise TraceError(f"{name}: no requests after the header; add one row per request")
    ranks = tuple(Priority)
    return Trace.of(Row(times[k], prompts[k], outputs[k], ranks[classes[k]]) for k in range(len(times)))


def csv_rows(raw: io.RawIOBase | io.BufferedIOBase, name: str, wanted: tuple[str, ...]
             ) -> Iterator[tuple[int, list[str]]]:
    """(line number, the cells of the `wanted` columns in that order) for each non-empty row after the header,
    which must name every wanted column (others are ignored)."""
    stream = io.BufferedReader(raw) if isinstance(raw, io.RawIOBase) else raw
    utf16 = stream.peek(2)[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    lines = _utf16_lines(stream, name) if utf16 else _utf8_lines(stream, name)
    reader = csv.reader(lines)
    columns = _header(_next(reader, name, 0), name, wanted)
    need = max(columns.values()) + 1
    line = reader.line_num
    while (cells := _next(reader, name, line)) is not None:
        line = reader.line_num
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) < need:
            missing = [c for c in wanted if columns[c] >= len(cells)]
            raise TraceError(f"{name} line {line}: no value for {', '.join(missing)} (the row has {len(cells)} "
                             f"of the header's columns); write one value per column")
        yield line, [cells[columns[c]] for c in wanted]


def write_csv(trace: Trace, path: Path) -> None:
    """The trace as CSV that read_csv reads back to the same rows (times written exactly)."""
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        writer.writerows((repr(r.t), r.prompt_tokens, r.output_tokens, r.priority.value) for r in trace.rows)


def _utf8_lines(stream: io.BufferedIOBase, name: str) -> Iterator[str]:
    """Decoded lines, each at most _FIELD_LIMIT bytes read (a file with no line breaks is not a trace)."""
    line = 0
    while chunk := stream.readline(_FIELD_LIMIT):
        line += 1
        _check_length(chunk, b"\n", name, line)
        try:
            yield chunk.decode("utf-8-sig" if line == 1 else "utf-8")
        except UnicodeDecodeError:
            raise TraceError(f"{name} line {line}: not UTF-8 text; save the file as UTF-8 CSV") from None


def _utf16_lines(stream: io.BufferedIOBase, name: str) -> Iterator[str]:
    text = io.TextIOWrapper(stream, encoding="utf-16", newline="")
    line = 0
    while True:
        try:
            chunk = text.readline(_FIELD_LIMIT)
        except UnicodeDecodeError:
            raise TraceError(f"{name} near line {line + 1}: not UTF-16 text; save the file as UTF-8 CSV") from None
        if not chunk:
            return
        line += 1
        _check_length(chunk, "\n", name, line)
        yield chunk


def _check_length(chunk: bytes | str, newline: bytes | str, name: str, line: int) -> None:
    if len(chunk) >= _FIELD_LIMIT and not chunk.endswith(newline):  # type: ignore[arg-type]
        raise TraceError(f"{name} line {line}: longer than {_FIELD_LIMIT:,} characters; write one request per "
                         "line: t,prompt_tokens,output_tokens,priority")


def _next(reader: Iterator[list[str]], name: str, line: int) -> list[str] | None:
    try:
        return next(reader)
    except StopIteration:
        return None
    except csv.Error as err:
        raise TraceError(f"{name} line {line + 1}: not CSV ({err}); write plain comma-separated values") from None


def _header(cells: list[str] | None, name: str, wanted: tuple[str, ...]) -> dict[str, int]:
    if cells is None:
        raise TraceError(f"{name}: the file is empty; its first line must be the header "
                         f"{','.join(wanted)}, then one row per line")
    columns: dict[str, int] = {}
    for k, cell in enumerate(cells):
        columns.setdefault(cell.strip().lower(), k)
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise TraceError(f"{name} line 1: the header has no column {', '.join(missing)}; the first line must "
                         f"name the columns, e.g. {','.join(wanted)} (found {','.join(cells)[:200]!r})")
    return {c: columns[c] for c in wanted}


def parse_time(cell: str, name: str, line: int, column: str = "t", most: float = MAX_TIME_S) -> float:
    """Seconds: from the trace's start (t) or a span; a TraceError naming the line otherwise."""
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= most):
        what = "seconds from the trace's start" if column == "t" else "seconds"
        raise TraceError(f"{name} line {line}: {column} is {cell[:40]!r}; write {what}, a number from 0 to "
                         f"{most:,.0f}")
    return value


def parse_tokens(cell: str, column: str, name: str, line: int, most: int = MAX_TOKENS) -> int:
    """A whole number from 1 to `most`; a TraceError naming the line otherwise."""
    try:
        value = int(cell.strip())
    except ValueError:
        value = -1
    if not 1 <= value <= most:
        raise TraceError(f"{name} line {line}: {column} is {cell[:40]!r}; write a whole number from 1 to "
                         f"{most:,}")
    return value


def _class(cell: str, name: str, line: int) -> int:
    try:
        return Priority(cell.strip().lower()).rank
    except ValueError:
        raise TraceError(f"{name} line {line}: priority is {cell[:40]!r}; write one of {PRIORITY_NAMES}") from None
