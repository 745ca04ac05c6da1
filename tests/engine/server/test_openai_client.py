"""The engine's HTTP API through the official `openai` client, against a real server process on loopback."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(tiny_server: str) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0, timeout=60)


def model_id(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client: OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and "tiny-llama" in models[0].id  # --model's value names the served model


def test_completion_returns_text_usage_and_length_finish(client: OpenAI) -> None:
    out = client.completions.create(model=model_id(client), prompt="The sea is", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0 and out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert isinstance(out.choices[0].text, str) and out.choices[0].text


def test_streamed_completion_equals_the_plain_one(client: OpenAI) -> None:
    args = dict(model=model_id(client), prompt=[5, 6, 7, 8], max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion_and_its_stream_agree(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=model_id(client), messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=model_id(client), messages=messages, max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_context_overflow_is_a_400_that_names_the_counts(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_id(client), prompt=[7] * 200, max_tokens=100)
    assert "maximum context length is 256 tokens" in err.value.message
    assert "300 tokens (200 in the prompt, 100 in the completion)" in err.value.message


def test_unknown_model_is_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(max_tokens=-5), "max_tokens must be >= 1"),
        (dict(temperature=-1), "temperature must be in"),
        (dict(top_p=2), "top_p must be in"),
        (dict(n=0), "n must be in [1, 128]"),
        (dict(n=500), "n must be in [1, 128]"),
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[99999999]), "token ids must be integers in [0, 49152)"),
        (dict(stop=[""]), "stop must be a non-empty string"),
        (dict(max_tokens="many"), "max_tokens"),
    ],
)
def test_invalid_completion_fields_are_400s_that_say_what_to_change(client: OpenAI, body: dict, message: str) -> None:
    args = dict(model=model_id(client), prompt="hi", max_tokens=2)
    args.update(body)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{k: v for k, v in args.items() if k in ("model", "prompt", "max_tokens")},
                                  extra_body={k: v for k, v in args.items() if k not in ("model", "prompt",
                                                                                          "max_tokens")})
    assert message in err.value.message


def test_empty_messages_are_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model_id(client), messages=[], max_tokens=2)


def test_completion_logprobs_match_the_tokens(client: OpenAI) -> None:
    out = client.completions.create(model=model_id(client), prompt="Once upon", max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the chosen token is the top one
        assert token in top


def test_chat_logprobs_in_stream_and_body(client: OpenAI) -> None:
    args = dict(model=model_id(client), messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    body = client.chat.completions.create(**args)
    content = body.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == body.choices[0].message.content
    streamed = [c for chunk in client.chat.completions.create(stream=True, **args) if chunk.choices
                and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_n_choices_with_seeds_differ_and_usage_counts_the_prompt_once(client: OpenAI) -> None:
    out = client.completions.create(model=model_id(client), prompt=[11, 12, 13, 14], max_tokens=6, n=3, seed=5,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1, "seeded copies should not all be the same"
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 18
    again = client.completions.create(model=model_id(client), prompt=[11, 12, 13, 14], max_tokens=6, n=3, seed=5,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_batched_prompts_answer_in_order(client: OpenAI) -> None:
    prompts = ["The sea", "A mountain", "Tomorrow"]
    out = client.completions.create(model=model_id(client), prompt=prompts, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    singles = [client.completions.create(model=model_id(client), prompt=p, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == singles


def test_streamed_chat_with_n_2_interleaves_two_complete_choices(client: OpenAI) -> None:
    args = dict(model=model_id(client), messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
                temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**args)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c.message.content for c in sorted(plain.choices, key=lambda c: c.index)]
