"""The gateway tokenizes a prompt exactly as the engines do (kvfleet/prompt_tokens.py): chats through the model's
template, piece by piece with a tenant's long system prompt remembered; a huge prompt only as far as routing needs,
and what it returns is always the start of the engine's own tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.tokenizer import Tokenizer
from kvfleet.prompt_tokens import CACHED_PIECE_CHARS, MAX_TOKENIZED_CHARS, prompt_tokenizer

SYSTEM = "You answer questions about the Harbor Lane bakery's opening hours, briefly.  " * 12


@pytest.fixture(scope="module")
def tokenize(smollm2_dir: Path):
    return prompt_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="module")
def engine_tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.mark.parametrize("question", ["When do you open?", " trailing  spaces  ", "日本語 🙂\n\nnew lines", ""])
def test_a_chat_gets_the_engines_tokens(tokenize, engine_tokenizer: Tokenizer, question: str) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(2):  # the second time the system prompt comes from the gateway's cache
        assert tokenize("/v1/chat/completions", {"messages": messages}) == engine_tokenizer.apply_chat_template(
            messages)


def test_content_parts_are_joined_as_the_engine_joins_them(tokenize, engine_tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": SYSTEM[:100]}, {"type": "text", "text": SYSTEM[100:]}]
    got = tokenize("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert got == engine_tokenizer.apply_chat_template([{"role": "user", "content": SYSTEM}])


def test_completion_prompts_text_and_token_ids(tokenize, engine_tokenizer: Tokenizer) -> None:
    assert tokenize("/v1/completions", {"prompt": SYSTEM}) == engine_tokenizer.encode(SYSTEM)
    assert tokenize("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tokenize("/v1/completions", {"prompt": [SYSTEM, "other"]}) == engine_tokenizer.encode(SYSTEM)


def test_a_huge_prompt_is_tokenized_only_as_far_as_routing_needs_and_its_start_is_exact(
        tokenize, engine_tokenizer: Tokenizer) -> None:
    text = "Describe the rye loaf, the spelt loaf and the seeded loaf in detail. " * (MAX_TOKENIZED_CHARS // 40)
    whole = engine_tokenizer.encode(text)
    got = tokenize("/v1/completions", {"prompt": text})
    assert 0 < len(got) < len(whole) and got == whole[:len(got)]
    chat = tokenize("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    whole_chat = engine_tokenizer.apply_chat_template([{"role": "user", "content": text}])
    assert 0 < len(chat) < len(whole_chat) and chat == whole_chat[:len(chat)]
    assert len(text) > 1.5 * MAX_TOKENIZED_CHARS > CACHED_PIECE_CHARS


def test_what_it_cannot_tokenize_routes_without_tokens(tokenize, tmp_path: Path, capsys) -> None:
    assert tokenize("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}) is None
    assert prompt_tokenizer(str(tmp_path / "no-such-model")) is None
    assert "approximate prefix table" in capsys.readouterr().err
    assert prompt_tokenizer(None) is None
