"""Request migration's plan (gateway/migration.py, pure): what the client was sent of an answer, the completion that
continues it from the exact token, and the continuation's events rewritten into the client's answer."""

from __future__ import annotations

import json

from kvfleet.gateway.migration import ABORTED, Answer, continuable_body, strip_token_ids


def event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chat_chunk(content: str | None, ids: list[int], finish: str | None = None, **top: object) -> bytes:
    delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
    return event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                               "token_ids": ids}], **top})


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0,
        "stream": True, "seed": 5, "stop": ["END"], "return_token_ids": True}


def test_a_chat_cut_short_is_continued_from_its_prompt_and_tokens_with_the_tokens_left() -> None:
    answer = Answer()
    answer.read([chat_chunk(None, [], prompt_token_ids=[1, 2, 3]), chat_chunk("Hel", [40]), chat_chunk("lo", [41])])
    assert answer.unfinished() == [0] and answer.chat
    follow = answer.continuation(CHAT, 0)
    assert follow["prompt"] == [1, 2, 3, 40, 41] and follow["max_tokens"] == 8
    assert follow["seed"] == 7 and follow["stop"] == ["END"] and follow["temperature"] == 0  # seed advanced by 2
    assert "messages" not in follow and follow["return_token_ids"] is True and follow["stream"] is True


def test_the_continuations_events_join_the_clients_answer_and_usage_counts_it_once() -> None:
    answer = Answer()
    answer.read([chat_chunk(None, [], prompt_token_ids=[1, 2, 3]), chat_chunk("Hel", [40]), chat_chunk("lo", [41])])
    answer.continuation(CHAT, 0)
    rest = event({"id": "cmpl-9", "object": "text_completion", "created": 99, "model": "m",
                  "choices": [{"index": 0, "text": " you", "logprobs": None, "finish_reason": None,
                               "token_ids": [42]}]})
    spliced = json.loads(answer.splice(rest, 0, keep_token_ids=False)[len(b"data: "):])
    assert spliced == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                       "choices": [{"index": 0, "delta": {"content": " you"}, "logprobs": None,
                                    "finish_reason": None}]}
    usage = event({"id": "cmpl-9", "object": "text_completion", "created": 99, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
    assert json.loads(answer.splice(usage, 0, False)[6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 5,
                                                                       "total_tokens": 8}


def test_an_answer_its_engine_aborted_is_unfinished_and_one_that_ended_is_not() -> None:
    aborted, ended = Answer(), Answer()
    aborted.read([chat_chunk(None, [], prompt_token_ids=[1]), chat_chunk("a", [9]), chat_chunk("", [], "abort")])
    ended.read([chat_chunk(None, [], prompt_token_ids=[1]), chat_chunk("a", [9]), chat_chunk("", [], "stop")])
    assert aborted.unfinished() == [0] and ended.unfinished() == []
    assert ABORTED.search(chat_chunk("", [], "abort")) and not ABORTED.search(chat_chunk("", [], "stop"))


def test_a_completion_keeps_its_shape_and_its_text_offsets_continue() -> None:
    answer = Answer()
    answer.read([event({"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "m",
                        "choices": [{"index": 0, "text": "abc", "prompt_token_ids": [7, 8], "token_ids": [1, 2],
                                     "finish_reason": None}]})])
    follow = answer.continuation({"model": "m", "prompt": "xy", "stream": True, "logprobs": 2}, 0)
    assert follow["prompt"] == [7, 8, 1, 2] and follow["max_tokens"] == 14 and follow["logprobs"] == 2  # of 16
    rest = event({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "text": "d", "finish_reason": "length", "token_ids": [3],
                               "logprobs": {"tokens": ["d"], "token_logprobs": [-0.5], "top_logprobs": [{"d": -0.5}],
                                            "text_offset": [0]}}]})
    spliced = json.loads(answer.splice(rest, 0, keep_token_ids=True)[6:])["choices"][0]
    assert spliced["text"] == "d" and spliced["logprobs"]["text_offset"] == [3] and spliced["token_ids"] == [3]


def test_what_cannot_be_continued_is_said() -> None:
    no_ids = Answer()
    no_ids.read([chat_chunk("Hel", [])])  # an engine that sent no prompt ids
    assert no_ids.continuation(CHAT, 0) is None
    done = Answer()
    done.read([chat_chunk(None, [], prompt_token_ids=[1]), chat_chunk("x" * 10, list(range(10)))])
    assert done.continuation(CHAT, 0) is None  # its 10 tokens are all there: nothing left to generate
    several = Answer()
    several.read([chat_chunk(None, [], prompt_token_ids=[1]), chat_chunk("a", [4])])
    assert several.continuation({**CHAT, "n": 2}, 0) is None


def test_only_a_stream_of_one_plain_choice_asks_for_token_ids_to_be_continued() -> None:
    stream = {**CHAT, "stream": True}
    assert continuable_body(stream) and continuable_body({**stream, "response_format": {"type": "text"}})
    assert not continuable_body({**CHAT, "stream": False})  # resent whole instead: nothing to continue from
    for shape in ({"n": 2}, {"best_of": 3}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}, {"prompt": ["a", "b"]}):
        assert not continuable_body({**stream, **shape}), shape
    assert continuable_body({**stream, "prompt": [1, 2, 3]})  # one prompt of token ids


def test_token_ids_the_client_did_not_ask_for_are_taken_out_of_its_events() -> None:
    raw = chat_chunk("Hel", [40, 41], prompt_token_ids=[1, 2])
    cleaned = json.loads(strip_token_ids(raw)[6:])
    assert "prompt_token_ids" not in cleaned and "token_ids" not in cleaned["choices"][0]
    assert cleaned["choices"][0]["delta"] == {"content": "Hel"}
