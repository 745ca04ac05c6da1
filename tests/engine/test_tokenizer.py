"""Tokenizer and IncrementalDetokenizer on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TRICKY_TEXTS = [
    "  two leading spaces, café, naïve, résumé, Ångström",
    "emoji 😀👍🏽👨‍👩‍👧 and flags 🇫🇷🇯🇵 done",
    "中文测试，你好世界！日本語のテキスト",
    "tabs\tand\nnewlines  \n  trailing spaces  ",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ and ẞǅ",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Tell me something."}])


def test_special_ids_and_vocab(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.bos_token_id == 1
    assert tokenizer.decode([2], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_formats_the_conversation(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.bos_token_id) == 3  # one <|im_start|> per turn, no extra BOS in front


def test_chat_template_without_generation_prompt(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>user\nHi<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\['content'\] must be a string, not int"),
        ([{"role": None, "content": "hi"}], r"messages\[0\]\['role'\] must be a string"),
    ],
)
def test_malformed_messages_say_what_is_wrong(tokenizer: Tokenizer, messages: Any, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        tokenizer.apply_chat_template(messages)


def _tokenizer_copy(smollm2_dir: Path, target: Path, chat_template: str | None) -> Tokenizer:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, target / name)
    if chat_template is not None:
        (target / "chat_template.jinja").write_text(chat_template)
    return Tokenizer(target)


def test_a_model_without_chat_template_points_to_completions(smollm2_dir: Path, tmp_path: Path) -> None:
    base = _tokenizer_copy(smollm2_dir, tmp_path / "base-model", chat_template=None)
    with pytest.raises(ValueError, match=r"model base-model has no chat template; use /v1/completions"):
        base.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_error_becomes_a_clear_value_error(smollm2_dir: Path, tmp_path: Path) -> None:
    strict = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('Conversation must start with system') }}{% endif %}"
    )
    tokenizer = _tokenizer_copy(smollm2_dir, tmp_path / "strict-model", chat_template=strict)
    with pytest.raises(ValueError, match="chat template of model strict-model rejected.*must start with system"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text", TRICKY_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_increments_add_up_to_the_full_decode(
    tokenizer: Tokenizer, chat_prompt: list[int], text: str, chunk: int
) -> None:
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, chat_prompt)
    increments = [detokenizer.push(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    assert "".join(increments) == tokenizer.decode(output_ids) == detokenizer.text
    assert not any("\ufffd" in piece for piece in increments)
    assert detokenizer.flush() == ""


def test_a_character_split_over_tokens_is_held_back_until_complete(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1  # its four bytes span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    assert [detokenizer.push([i]) for i in emoji_ids] == [""] * (len(emoji_ids) - 1) + ["😀"]


def test_flush_returns_an_unfinished_character(tokenizer: Tokenizer) -> None:
    partial = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    streamed = "".join(detokenizer.push([i]) for i in partial)
    assert streamed + detokenizer.flush() == tokenizer.decode(partial)
    assert detokenizer.text.endswith("\ufffd")


@pytest.mark.parametrize(("skip", "expected"), [(True, "Paris."), (False, "Paris.<|im_end|>")])
def test_special_tokens_in_the_output(tokenizer: Tokenizer, chat_prompt: list[int], skip: bool, expected: str) -> None:
    output_ids = tokenizer.encode("Paris.", add_special_tokens=False) + [2]
    detokenizer = IncrementalDetokenizer(tokenizer, chat_prompt, skip_special_tokens=skip)
    assert "".join(detokenizer.push([i]) for i in output_ids) == expected


def test_a_long_output_streams_exactly(tokenizer: Tokenizer, chat_prompt: list[int]) -> None:
    output_ids = tokenizer.encode(" ".join(TRICKY_TEXTS) * 20, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, chat_prompt)
    streamed = "".join(detokenizer.push([i]) for i in output_ids)
    assert streamed == tokenizer.decode(output_ids)


@pytest.mark.parametrize("configured", ["GPT2Tokenizer", None])
def test_a_model_naming_another_tokenizer_class_tokenizes_the_same(
        smollm2_dir: Path, tmp_path: Path, tokenizer: Tokenizer, configured: str | None) -> None:
    """SmolLM2 as the Hub ships it names GPT2Tokenizer, and other directories name none: AutoTokenizer loads those
    (the generic fast tokenizer is loaded directly only where the directory names it), with the same ids."""
    target = tmp_path / "hub-model"
    target.mkdir()
    for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, target / name)
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    if configured is not None:
        config["tokenizer_class"] = configured
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    other = Tokenizer(target)
    messages = [{"role": "user", "content": TRICKY_TEXTS[1]}]
    assert other.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert [other.encode(t) for t in TRICKY_TEXTS] == [tokenizer.encode(t) for t in TRICKY_TEXTS]
    assert (other.vocab_size, other.bos_token_id, other.eos_token_ids) == (
        tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_ids)
