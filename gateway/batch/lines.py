"""A batch's input file, line by line (pure): OpenAI's Batch API input format, each line checked on its own, so one
bad line is one error-file entry and the rest of the batch runs.

A line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}`; the body is checked
against the engines' own strict schema (kvfleet/fleet/openai_schema.py), as an interactive request's is, and its
`model` must be one the gateway serves. A `custom_id` seen on an earlier line makes the later line an error: each
custom_id is answered exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvfleet.fleet.openai_schema import RequestSchemaError, parse_json, validate_request
from kvfleet.gateway.token_estimate import request_cost

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Line:
    """A request line that passed its checks: its 1-based line number in the file."""

    number: int
    custom_id: str
    body: dict


@dataclass(frozen=True)
class LineError:
    """A line that will not run: the error-file entry says which line, its custom_id when it had one, and why."""

    number: int
    custom_id: str | None
    code: str
    message: str


def read_line(number: int, raw: bytes, endpoint: str, serves: Callable[[str], bool]) -> Line | LineError:
    """One line of the input file, checked; `serves(model)` says whether the gateway serves that model."""
    try:
        value = parse_json(raw)
    except RequestSchemaError as err:
        return LineError(number, None, "invalid_json", f"line {number}: {err.message}")
    if not isinstance(value, dict):
        return LineError(number, None, "invalid_request", f"line {number}: must be a JSON object with custom_id, "
                                                          "method, url and body")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return LineError(number, None, "invalid_custom_id", f"line {number}: custom_id must be a string of 1 to "
                                                            f"{MAX_CUSTOM_ID} characters")

    def error(code: str, message: str) -> LineError:
        return LineError(number, custom_id, code, f"line {number}: {message}")

    if value.get("method") != "POST":
        return error("invalid_method", f"method must be POST, not {value.get('method')!r:.40}")
    if value.get("url") != endpoint:
        return error("mismatched_endpoint", f"url {value.get('url')!r:.80} is not the batch's endpoint {endpoint}; "
                                            "a batch runs one endpoint")
    body = value.get("body")
    try:
        validate_request(endpoint, body)
    except RequestSchemaError as err:
        return error("invalid_body", f"body: {err.message}")
    if body.get("stream"):
        return error("invalid_body", "body.stream must be false or absent: a batch's answers are files")
    if not serves(body["model"]):
        return error("model_not_found", f"model {body['model']!r:.120} is not served here (GET /v1/models lists "
                                        "what is)")
    return Line(number, custom_id, body)


def read_lines(data: bytes, endpoint: str, serves: Callable[[str], bool]) -> Iterator[Line | LineError]:
    """Every non-blank line of the file, in order, with later duplicates of a custom_id as errors."""
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        line = read_line(number, raw, endpoint, serves)
        if isinstance(line, Line):
            if line.custom_id in seen:
                line = LineError(number, line.custom_id, "duplicate_custom_id",
                                 f"line {number}: custom_id {line.custom_id!r:.80} appears on an earlier line; each "
                                 "request needs its own")
            else:
                seen.add(line.custom_id)
        yield line


def token_estimate(body: dict) -> tuple[int, int]:
    """A checked request body's (prompt tokens, output tokens), the gateway's one estimate (gateway/token_estimate.py):
    what the autoscaler plans a batch's backlog with and a key's batch token limit counts."""
    cost = request_cost(body)
    return cost.prompt, cost.completion


def file_tokens(data: bytes, endpoint: str) -> int:
    """The tokens a batch file's good lines would enqueue (prompt estimate + output), whatever models they name."""
    total = 0.0
    for line in read_lines(data, endpoint, lambda _: True):
        if isinstance(line, Line):
            prompt, output = token_estimate(line.body)
            total += prompt + output
    return round(total)
