"""What routers in front of a kvfleet engine ask of it, as vLLM and SGLang servers answer: /tokenize and /detokenize
(vllm-router's prefix-aware policies), /server_info, /model_info and /get_load (sglang-router and smg), the fields they
add to every request (echo, skip_special_tokens, no_stop_trim, ...), served and never logged as unknown; and the
hostile forms of each answered 4xx naming the field. A real engine process on the tiny model (SmolLM2's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import kvfleet
from tests.conftest import start_engine_server, stop_process

IM_START = 1  # <|im_start|> in SmolLM2's vocabulary: special, and not an end-of-sequence token
SGLANG_ROUTER_EXTRAS = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                        "return_hidden_states": False}
SGLANG_ROUTER_CHAT_EXTRAS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                             "continue_final_message": False, "skip_special_tokens": True,
                             "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                             "include_reasoning": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    proc, url = start_engine_server(tiny_model_dir, "--served-model-name", "tiny")
    yield url
    stop_process(proc)


def post(engine: str, path: str, body: dict) -> httpx.Response:
    """JSON with non-ASCII escaped, so a lone surrogate travels as the text `\\ud800`, as a hostile client sends it."""
    return httpx.post(engine + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


def ignored_fields(engine: str) -> float:
    for line in httpx.get(engine + "/metrics").text.splitlines():
        if line.startswith("kvfleet_request_ignored_fields_total "):
            return float(line.split()[1])
    return 0.0


def test_tokenize_a_prompt_and_detokenize_it_back(engine: str) -> None:
    out = post(engine, "/tokenize", {"model": "tiny", "prompt": "The capital of France", "return_token_strs": True})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["count"] == len(body["tokens"]) > 2 and body["max_model_len"] == 256
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "The capital of France"
    back = post(engine, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert back.json() == {"prompt": "The capital of France"}


def test_tokenize_a_chat_as_the_engine_runs_it(engine: str) -> None:
    """The same token ids the chat route renders, and continue_final_message leaves the assistant's turn open."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    rendered = post(engine, "/v1/chat/completions/render", {"messages": messages[:1]}).json()["token_ids"]
    assert post(engine, "/tokenize", {"messages": messages[:1]}).json()["tokens"] == rendered
    opened = post(engine, "/tokenize", {"messages": messages, "continue_final_message": True}).json()["tokens"]
    closed = post(engine, "/tokenize", {"messages": messages}).json()["tokens"]
    assert post(engine, "/detokenize", {"tokens": opened}).json()["prompt"].endswith("The colour is")
    assert not post(engine, "/detokenize", {"tokens": closed}).json()["prompt"].endswith("The colour is")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"prompt": "x" * 2_000_000}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/detokenize", {"tokens": [5, 10**9]}, "tokens.1"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1] * 20_000}, "tokens"),
    ("/v1/completions", {"prompt": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": [5] * 300_000, "echo": True}, "prompt"),  # refused, never decoded for the echo
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_hostile_router_fields_get_a_400_naming_the_field(engine: str, path: str, body: dict, param: str) -> None:
    out = post(engine, path, body)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param


def test_deeply_nested_tokenize_body_is_a_400(engine: str) -> None:
    body = '{"prompt": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    out = httpx.post(engine + "/tokenize", content=body, headers={"content-type": "application/json"})
    assert out.status_code == 400 and "nests deeper" in out.json()["error"]["message"]


def test_another_model_is_a_404(engine: str) -> None:
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "a"}), ("/detokenize", {"model": "x", "tokens": []})):
        out = post(engine, path, body)
        assert out.status_code == 404 and out.json()["error"]["code"] == "model_not_found"


def test_sglang_discovery_names_the_served_model(engine: str) -> None:
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        info = httpx.get(engine + path).json()
        assert info["served_model_name"] == "tiny", path
        assert (Path(info["tokenizer_path"]) / "tokenizer.json").exists()  # a router on this host can load it
    server = httpx.get(engine + "/get_server_info").json()
    assert server["model_id"] == "tiny" and server["kv_block_size"] == 16  # vLLM's discovery keys, same route
    assert server["context_length"] == 256 and server["max_running_requests"] > 0
    assert httpx.get(engine + "/version").json() == {"version": kvfleet.__version__}  # vLLM's; smg probes it
    load = httpx.get(engine + "/get_load").json()
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0 and load[0]["num_waiting_reqs"] == 0


def test_echo_puts_the_prompt_before_the_completion(engine: str) -> None:
    out = post(engine, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "temperature": 0,
                                           "echo": True}).json()
    plain = post(engine, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}).json()
    assert out["choices"][0]["text"] == "Hello there" + plain["choices"][0]["text"]
    ids = post(engine, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
    by_ids = post(engine, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True}).json()
    assert by_ids["choices"][0]["text"].startswith("Hello there")


def test_streamed_echo_sends_the_prompt_first(engine: str) -> None:
    with httpx.stream("POST", engine + "/v1/completions", json={
            "prompt": ["one", "two"], "max_tokens": 2, "temperature": 0, "echo": True, "stream": True}) as out:
        chunks = [line.removeprefix("data: ") for line in out.iter_lines() if line.startswith("data: {")]
    first = [json.loads(c)["choices"][0] for c in chunks[:2]]
    assert {(c["index"], c["text"]) for c in first} == {(0, "one"), (1, "two")}


def test_chat_echo_repeats_the_assistants_last_message(engine: str) -> None:
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    out = post(engine, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "echo": True,
                                                "continue_final_message": True}).json()
    assert out["choices"][0]["message"]["content"].startswith("One, two,")
    user_last = post(engine, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 2, "echo": True,
                                                      "temperature": 0}).json()
    assert not user_last["choices"][0]["message"]["content"].startswith("Count.")


def test_skip_special_tokens_false_keeps_them_in_the_text(engine: str) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "logit_bias": {str(IM_START): 100}}
    assert post(engine, "/v1/completions", body).json()["choices"][0]["text"] == ""
    kept = post(engine, "/v1/completions", body | {"skip_special_tokens": False}).json()["choices"][0]["text"]
    assert kept == "<|im_start|>" * 3


def test_no_stop_trim_keeps_the_stop_string(engine: str) -> None:
    a = post(engine, "/tokenize", {"prompt": "a", "add_special_tokens": False}).json()["tokens"][0]
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100}, "stop": "aa"}
    assert post(engine, "/v1/completions", body).json()["choices"][0]["text"] == ""
    for flag in ("no_stop_trim", "include_stop_str_in_output"):
        assert post(engine, "/v1/completions", body | {flag: True}).json()["choices"][0]["text"] == "aa", flag


def test_the_fields_routers_add_are_known_not_ignored(engine: str) -> None:
    before = ignored_fields(engine)
    assert post(engine, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": False,
                                            **SGLANG_ROUTER_EXTRAS}).status_code == 200
    assert post(engine, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": 2, "stream": False,
                                                 **SGLANG_ROUTER_CHAT_EXTRAS}).status_code == 200
    assert ignored_fields(engine) == before
