"""A table of malformed and hostile requests over raw HTTP: each gets the right 4xx and a message that says
what to change; none gets a 5xx, and the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, raw body or JSON object, status, a fragment of the message)
CASES = [
    (C, b"", 400, "body"),
    (C, b"{", 400, "not valid JSON"),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature: Input should be a finite number"),
    (C, b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    (C, b'{"prompt": "hi", "max_tokens": 1e400}', 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 10**12}, 400, "maximum context length is 256 tokens"),
    (C, {"prompt": [1] * 5000, "max_tokens": 1}, 400, "maximum context length is 256 tokens"),
    (C, {"prompt": [[1, 2], "mixed"]}, 400, "prompt"),
    (C, {"prompt": ["a"] * 65, "max_tokens": 1}, 400, "at most 64 prompts per request"),
    (C, {"prompt": [-1]}, 400, "token ids must be integers in [0, 49152)"),
    (C, {"prompt": "hi", "stop": ["x"] * 17}, 400, "stop takes at most 16 strings"),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "hi", "seed": 2**70}, 400, "seed: Input should be less than 18446744073709551616"),
    (C, {"prompt": "hi", "seed": "lucky"}, 400, "seed"),
    (C, {"prompt": "hi", "top_k": -7}, 400, "top_k must be -1 (no limit) or in [1, 49152]"),
    (C, {"prompt": "hi", "min_p": -0.5}, 400, "min_p must be in"),
    (C, {"prompt": "hi", "frequency_penalty": 9}, 400, "frequency_penalty must be in"),
    (C, {"prompt": "hi", "stream_options": "yes"}, 400, "stream_options"),
    (C, {"prompt": "hi", "stop_token_ids": [-3]}, 400, "stop_token_ids[0] must be a token id in [0, 49152)"),
    (C, {"prompt": "hi", "model": "../../etc/passwd"}, 404, "does not exist"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens must be >= 1"),
    (CHAT, {"messages": MSG, "top_logprobs": 99, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [[]]}, 400, "messages.0"),
    (CHAT, {"messages": MSG * 2000, "max_tokens": 1}, 400, "maximum context length is 256 tokens"),
    (CHAT, {"messages": MSG, "n": 1000}, 400, "n must be in [1, 128]"),
    (CHAT, {"prompt": "wrong endpoint"}, 400, "messages"),
]


@pytest.fixture(scope="module")
def http(tiny_server: str):
    with httpx.Client(base_url=tiny_server, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("path", "body", "status", "fragment"), CASES)
def test_hostile_request_gets_a_clear_4xx(http: httpx.Client, path: str, body, status: int, fragment: str) -> None:
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error["message"]
    assert error["type"] and set(error) == {"message", "type", "param", "code"}


def test_server_still_serves_after_the_table(http: httpx.Client) -> None:
    response = http.post(C, json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
