"""`return_token_ids`, in vLLM's fields, through the official `openai` client against a real engine process: the
prompt's token ids and each choice's generated ones, whole or chunk by chunk. With them an answer can be continued
from its exact token on another engine: the prompt's ids plus the ids generated so far, as a completion's prompt
with the tokens left, give (greedy, float32) the same rest of the answer."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

TOKEN_IDS = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server: str) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def tokenize(server: str, model: str, text: str) -> list[int]:
    return httpx.post(f"{server}/tokenize", json={"model": model, "prompt": text}, timeout=30).json()["tokens"]


def test_a_completion_names_its_prompts_and_its_own_tokens(client: OpenAI, model: str, tiny_server: str) -> None:
    answer = client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0,
                                       extra_body=TOKEN_IDS).model_dump()
    [choice] = answer["choices"]
    assert choice["prompt_token_ids"] == tokenize(tiny_server, model, "The sea is")
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"] == 6
    plain = client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]  # only if asked


def test_a_stream_carries_the_prompt_once_and_every_token_once(client: OpenAI, model: str) -> None:
    args = dict(model=model, prompt=[5, 6, 7, 8], max_tokens=9, temperature=0, extra_body=TOKEN_IDS)
    whole = client.completions.create(**args).model_dump()["choices"][0]
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **args)]
    prompts = [c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"][0].get("prompt_token_ids")]
    assert prompts == [[5, 6, 7, 8]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]


def test_a_chat_names_its_templated_prompt_and_its_tokens_whole_or_streamed(client: OpenAI, model: str) -> None:
    args = dict(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=7, temperature=0,
                extra_body=TOKEN_IDS)
    whole = client.chat.completions.create(**args).model_dump()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]  # the template applied
    assert len(whole["choices"][0]["token_ids"]) == 7
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **args)]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == whole["choices"][0]["token_ids"]


def test_an_answer_continued_from_its_exact_token_ends_as_the_whole_answer(client: OpenAI, model: str) -> None:
    """What the gateway does with an answer its engine dropped: the prompt's ids and the ids generated so far as
    a new prompt, with the tokens left, and the rest is the same (greedy)."""
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story."}],
                                          max_tokens=12, temperature=0, extra_body=TOKEN_IDS).model_dump()
    prompt, generated = chat["prompt_token_ids"], chat["choices"][0]["token_ids"]
    for cut in (1, 5, 11):
        rest = client.completions.create(model=model, prompt=prompt + generated[:cut], max_tokens=12 - cut,
                                         temperature=0, extra_body=TOKEN_IDS).model_dump()
        assert generated[:cut] + rest["choices"][0]["token_ids"] == generated, cut


def test_return_token_ids_must_be_true_or_false(tiny_server: str, model: str) -> None:
    refused = httpx.post(f"{tiny_server}/v1/completions", timeout=30,
                         json={"model": model, "prompt": "hi", "max_tokens": 1, "return_token_ids": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids"
