"""The one strict schema of OpenAI request bodies (plus vLLM's extras), shared by the engine and the gateway.

Types are strict, as OpenAI's API is: `"stream": "yes"`, `"max_tokens": "4"`, `true` or `4.0` are refused, not
coerced. Before pydantic sees a body, one cheap walk bounds its nesting depth and refuses text that is not valid
Unicode (lone surrogates such as `"\\ud800"`), naming the field. Unknown fields are accepted and ignored.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions without max_tokens
MAX_JSON_DEPTH = 32  # OpenAI bodies nest at most ~5 deep (messages → content parts → part); 32 leaves room
MAX_UNKNOWN_FIELDS_REPORTED = 8  # unknown field names echoed in a log line, each repr()-escaped
INT64 = 2**63
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestSchemaError(ValueError):
    """A body that does not fit the schema; param names the offending field (dotted path), when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


Int64 = Annotated[StrictInt, Field(ge=-INT64, lt=INT64)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions; unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int64 = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[StrictInt, Field(ge=-INT64, lt=2**64)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    user: StrictStr | None = None
    logit_bias: dict[StrictStr, Float] | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: Float = 0.0
    repetition_penalty: Float = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[Int64] | None = None
    priority: Int64 = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # the prompt's token ids and each choice's generated ones in the answer, in vLLM's fields: what a gateway needs to
    # continue an answer its engine dropped on another engine, from the exact token
    return_token_ids: StrictBool = False
    # SGLang's names and no-ops, as sglang-router and smg add them to every request they forward
    no_stop_trim: StrictBool = False  # SGLang's include_stop_str_in_output
    return_hidden_states: StrictBool = False  # refused when true (check_against_model)
    separate_reasoning: StrictBool = True  # no reasoning parser runs: nothing to separate or stream apart
    stream_reasoning: StrictBool = True

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[Int64] | list[list[Int64]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False  # the prompt before the completion's text


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        """The message's text; content parts of type text are joined, other parts are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError("only text content parts are supported")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False  # vLLM's: the last message's content first, when it is the assistant's
    continue_final_message: StrictBool = False  # vLLM's: extend the last (assistant) message, no new turn
    include_reasoning: StrictBool = True  # no reasoning parser runs: a no-op

    @field_validator("messages")
    @classmethod
    def _text_only(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for message in messages:
            message.text()  # raises for non-text parts, before any work is done
        return messages

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


SCHEMAS: dict[str, type[SamplingRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def parse_json(raw: bytes) -> object:
    """The JSON value of a request body; RequestSchemaError for bytes that are not JSON or nest too deep."""
    try:
        return json.loads(raw)
    except RecursionError as err:
        raise RequestSchemaError(f"body: nests deeper than {MAX_JSON_DEPTH} levels; flatten it") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestSchemaError("the body is not valid JSON; send a JSON object") from err


def check_json_value(value: object) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and text with lone surrogates, naming where (iterative, cheap: it
    runs on every request; ASCII text cannot hold a surrogate and is not visited, and a path is only built for the
    error)."""
    stack: list[_Visit] = [(value, None, None, 1)]
    while stack:
        visit = stack.pop()
        item, _, _, depth = visit
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                param = _dotted(_path(visit))
                raise RequestSchemaError(
                    f"{param or 'body'}: contains a lone UTF-16 surrogate (such as \\ud800), which is not valid "
                    "Unicode text; send valid UTF-8 text", param)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            param = _dotted(_path(visit)[:1]) or None
            raise RequestSchemaError(f"{param or 'body'}: nests deeper than {MAX_JSON_DEPTH} levels; flatten it",
                                     param)
        entries = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in entries:
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise RequestSchemaError("a field name contains a lone UTF-16 surrogate; send valid UTF-8 text",
                                         _dotted(_path(visit)))
            if isinstance(child, dict | list) or (isinstance(child, str) and not child.isascii()):
                stack.append((child, visit, key, depth + 1))


_Visit = tuple[object, "_Visit | None", object, int]  # a value, the visit of its container, its key there, its depth


def _path(visit: _Visit) -> tuple:
    """The keys from the body down to a visited value."""
    keys = []
    while visit[1] is not None:
        keys.append(visit[2])
        visit = visit[1]
    return tuple(reversed(keys))


def validate_request(path: str, body: object, schemas: Mapping[str, type[BaseModel]] = SCHEMAS) -> BaseModel:
    """The strict model of body for the route path; RequestSchemaError names the first field that does not fit."""
    schema = schemas.get(path)
    if schema is None:
        raise RequestSchemaError(f"no request schema for {path}; use /v1/completions or /v1/chat/completions")
    if not isinstance(body, dict):
        raise RequestSchemaError("body: the body must be a JSON object")
    check_json_value(body)
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        # of a union's branches, the error that got furthest into the value says best what is wrong
        first = max(err.errors(include_url=False), key=_specificity)
        param = _dotted(first.get("loc", ())) or None
        raise RequestSchemaError(f"{param or 'body'}: {_message(first)}", param) from None


def describe_unknown_fields(names: list[str]) -> str:
    """Unknown field names for a log line: repr()-escaped (no raw newlines) and at most a few of them."""
    shown = ", ".join(repr(name[:64]) for name in names[:MAX_UNKNOWN_FIELDS_REPORTED])
    more = len(names) - MAX_UNKNOWN_FIELDS_REPORTED
    return shown + (f" and {more} more" if more > 0 else "")


def is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _message(error: dict[str, Any]) -> str:
    """pydantic's message, with the wrong value's JSON type said plainly for type errors."""
    message = str(error.get("msg", "invalid value"))
    if error.get("type", "").endswith("_type") and "input" in error:
        return f"{message}, got {_json_type(error['input'])}"
    return message


def _specificity(error: dict[str, Any]) -> tuple:
    parts = _dotted(error.get("loc", ())).split(".")
    type_error = str(error.get("type", "")).endswith("_type")
    return len(parts), tuple(int(p) if p.isascii() and p.isdigit() else -1 for p in parts), not type_error


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "an array" if isinstance(value, list) else "an object"


def _dotted(loc: tuple | list) -> str:
    """pydantic's location as a dotted path, skipping union-branch labels such as `list[int]`."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool"}))]
    return ".".join(parts)
