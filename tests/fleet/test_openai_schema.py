"""The shared strict request schema: wrong JSON types, deep nesting and invalid text are 400s naming the field,
from validate_request (what the gateway calls) and from a real engine over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from kvfleet.fleet.openai_schema import MAX_JSON_DEPTH, RequestSchemaError, describe_unknown_fields, validate_request

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


# (path, body, the param the error names, a fragment of its message)
REFUSED = [
    (C, {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean, got a string"),
    (C, {"prompt": "hi", "max_tokens": "4"}, "max_tokens", "valid integer, got a string"),
    (C, {"prompt": "hi", "max_tokens": True}, "max_tokens", "valid integer, got a boolean"),
    (C, {"prompt": "hi", "max_tokens": 4.0}, "max_tokens", "valid integer, got a number"),
    (C, {"prompt": "hi", "n": "2"}, "n", "valid integer"),
    (C, {"prompt": "hi", "temperature": "0.5"}, "temperature", "got a string"),
    (C, {"prompt": "hi", "seed": 2**64}, "seed", "less than 18446744073709551616"),
    (C, {"prompt": "hi", "seed": -(2**63) - 1}, "seed", "greater than or equal to"),
    (C, {"prompt": "hi", "stop": ["ok", 3]}, "stop.1", "valid string, got a number"),
    (C, {"prompt": [1, "two"]}, "prompt.1", "valid integer, got a string"),
    (C, {"prompt": [1, 2**64]}, "prompt.1", "less than"),
    (C, {"prompt": "hi", "logit_bias": {"5": "up"}}, "logit_bias.5", "got a string"),
    (C, {"prompt": "hi", "logit_bias": {"\u00b9": "up"}}, "logit_bias.\u00b9", "got a string"),  # '¹'.isdigit()
    (C, {"prompt": "\ud800"}, "prompt", "lone UTF-16 surrogate"),
    (C, {"prompt": ["ok", "a\udfffb"]}, "prompt.1", "lone UTF-16 surrogate"),
    (C, {"prompt": "hi", "stop": "\ud800"}, "stop", "lone UTF-16 surrogate"),
    (C, {"prompt": "hi", "user": "\udc00"}, "user", "lone UTF-16 surrogate"),
    (C, {"prompt": "hi", "extra": nested(MAX_JSON_DEPTH + 5)}, "extra", f"deeper than {MAX_JSON_DEPTH} levels"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content", "lone UTF-16 surrogate"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages.0.content.0.text", "lone UTF-16 surrogate"),
    (CHAT, {"messages": MSG, "logprobs": 1}, "logprobs", "valid boolean"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "valid boolean"),
]


@pytest.mark.parametrize(("path", "body", "param", "fragment"), REFUSED)
def test_validate_request_refuses_and_names_the_field(path: str, body: dict, param: str, fragment: str) -> None:
    with pytest.raises(RequestSchemaError) as err:
        validate_request(path, body)
    assert err.value.param == param
    assert fragment in err.value.message and err.value.message.startswith(param)


def test_valid_bodies_pass_and_unknown_fields_are_ignored() -> None:
    body = validate_request(C, {"prompt": "hi", "temperature": 1, "seed": 2**64 - 1, "best_of": 3,
                                "weird\nfield": 1, "stop": "x"})
    assert body.temperature == 1.0 and body.seed == 2**64 - 1
    assert body.unknown_fields() == ["best_of", "weird\nfield"]
    chat = validate_request(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})
    assert chat.messages[0].text() == "a"


def test_unknown_field_names_are_escaped_and_bounded_for_logs() -> None:
    line = describe_unknown_fields(["evil\nINFO forged line"] + [f"f{i}" for i in range(20)])
    assert "\n" not in line and "'evil\\nINFO forged line'" in line and "and 13 more" in line


@pytest.fixture(scope="module")
def http(tiny_server: str):
    with httpx.Client(base_url=tiny_server, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("path", "body", "param", "fragment"), REFUSED)
def test_the_engine_answers_400_naming_the_field(http: httpx.Client, path: str, body: dict, param: str,
                                                 fragment: str) -> None:
    response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]


def test_json_nested_past_the_parser_is_a_400(http: httpx.Client) -> None:
    deep = b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = http.post(C, content=deep, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nests deeper" in response.json()["error"]["message"]


@pytest.mark.parametrize("field", [{"stop_token_ids": [49152]}, {"top_k": 49153}, {"logit_bias": {"99999": 1}},
                                   {"logit_bias": {"5": 101}}, {"logit_bias": {"\u00b9": 1}},
                                   {"logit_bias": {"\u0665": 1}}, {"top_k": 2**62}, {"n": 3, "prompt": ["a"] * 64}])
def test_values_beyond_the_model_are_400s(http: httpx.Client, field: dict) -> None:
    response = http.post(C, json={"prompt": "hi", "max_tokens": 2, **field})
    assert response.status_code == 400, response.text
    expected = "n" if "n" in field else next(iter(field))
    assert response.json()["error"]["param"].startswith(expected)


def test_seed_at_the_top_of_its_range_with_n_2_is_served(http: httpx.Client) -> None:
    response = http.post(C, json={"prompt": "hi", "max_tokens": 3, "seed": 2**64 - 1, "n": 2, "temperature": 1})
    assert response.status_code == 200, response.text
    assert [c["finish_reason"] for c in response.json()["choices"]] == ["length", "length"]
