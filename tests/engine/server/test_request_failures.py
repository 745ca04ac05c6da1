"""A request that fails in the engine says so: a 400 (its own fault) when not streaming, an error event then [DONE]
when streaming; never a silent end. Requests beside it are served exactly as if it had not been there."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

# Valid in type and range (vLLM takes any repetition_penalty > 0), but it divides logits by 1e-300: the row's
# probabilities are not finite, so the sampler fails this request, and only this one.
POISON = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "repetition_penalty": 1e-300}
VICTIM = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(tiny_server: str):
    with httpx.Client(base_url=tiny_server, timeout=60) as client:
        yield client


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_failed_request_is_a_400_with_its_reason(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=POISON)
    assert response.status_code == 400 and "x-kvfleet-fault" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "request_failed" and "non-finite" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failed_stream_ends_with_an_error_event_then_done(http: httpx.Client, path: str) -> None:
    body = {**POISON, "stream": True}
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_failed" and set(error) == {"message", "type", "param", "code"}
    for event in events[:-2]:
        assert all(choice["finish_reason"] is None for choice in json.loads(event)["choices"])


def test_every_completed_streamed_choice_carries_its_finish_reason(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json={**VICTIM, "stream": True, "n": 2}) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    reasons = {c["index"]: c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]
               if c["finish_reason"]}
    assert reasons == {0: "length", 1: "length"}


def test_victims_beside_failing_and_extreme_requests_get_unchanged_answers(http: httpx.Client) -> None:
    alone = http.post("/v1/completions", json=VICTIM).json()["choices"][0]["text"]
    hostile = [POISON, {**POISON, "stream": True}, {"prompt": "x", "seed": 2**64 - 1, "n": 4, "temperature": 1},
               {"prompt": "x", "top_k": 49152, "top_p": 0.5, "temperature": 1, "logprobs": 20},
               {"prompt": "x", "logit_bias": {"0": 100, "49151": -100}, "stop": ["\n", "the"], "temperature": 1},
               {"prompt": "\ud800"}]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        victims = [pool.submit(http.post, "/v1/completions", json=VICTIM) for _ in range(4)]
        attacks = [pool.submit(http.post, "/v1/completions", content=json.dumps(body),  # ASCII-escaped JSON
                               headers={"content-type": "application/json"}) for body in hostile * 2]
        statuses = [f.result().status_code for f in attacks]
        answers = [f.result().json()["choices"][0] for f in victims]
    assert all(status in (200, 400) for status in statuses), statuses
    assert all(a["text"] == alone and a["finish_reason"] == "length" for a in answers)
