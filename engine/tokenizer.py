"""Text <-> token ids for a local Hugging Face model directory, and streaming detokenization."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

# Output tokens are decoded together with this many tokens before them, so that a token's text
# (its leading space, or bytes of a character that started earlier) comes out as in the full decode.
DETOKENIZE_CONTEXT_TOKENS = 5

# The tokenizer classes AutoTokenizer resolves to the generic fast tokenizer (tokenizer.json run by the Rust
# `tokenizers`; transformers 5 names it TokenizersBackend). Loaded as that class directly, transformers' model
# registry is never imported: 1.1 s instead of 2.8 s here, of an engine's ~5 s start.
GENERIC_FAST_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


class Tokenizer:
    """A Hugging Face tokenizer loaded from local files only, with the engine's view of special ids."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = Path(model_dir)
        self._hf = _load(self.model_dir)
        self.vocab_size: int = len(self._hf)
        self.bos_token_id: int | None = self._hf.bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            {*_as_ids(self._hf.eos_token_id), *_generation_config_eos_ids(self.model_dir)}
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token can stand for (see prompt_limits)."""
        tokens = self._hf.convert_ids_to_tokens(list(range(len(self._hf))))
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=1)
        # a normalizer (NFC, NFKC, lowercasing...) may shorten text before it is split; allow for that
        backend = getattr(self._hf, "backend_tokenizer", None)
        return longest * (1 if backend is not None and backend.normalizer is None else 4)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; ValueError (not the tokenizer's TypeError) for text that is not valid Unicode."""
        try:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError as err:  # the Rust tokenizer refuses str holding lone surrogates this way
            if isinstance(text, str) and not _is_valid_unicode(text):
                raise ValueError("the text contains a lone UTF-16 surrogate (such as \\ud800); send valid "
                                 "UTF-8 text") from err
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each token's own string in the vocabulary (byte-level pieces, as vLLM's /tokenize returns them)."""
        return self._hf.convert_ids_to_tokens(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """The prompt token ids for a chat conversation, as the model's own template formats it; with
        continue_final_message the last (assistant) message is left open for the model to extend."""
        if not self.has_chat_template:
            raise ValueError(
                f"model {self.model_dir.name} has no chat template; use /v1/completions with a plain prompt"
            )
        check_messages(messages)
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message extends the last message, which must be the assistant's; "
                             "end the messages with an assistant message or send false")
        try:
            prompt = self._hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tokenize=False)
        except TemplateError as err:
            raise ValueError(f"the chat template of model {self.model_dir.name} rejected the messages: {err}") from err
        # The template already wrote the special tokens (BOS, role markers) it wants.
        return self.encode(prompt, add_special_tokens=False)


def check_messages(messages: Any) -> None:
    """Raise ValueError saying which chat message is malformed and how."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', not {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no '{key}'; every message needs 'role' and 'content'")
            if not isinstance(message[key], str):
                raise ValueError(f"messages[{i}]['{key}'] must be a string, not {type(message[key]).__name__}")


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text increments (vLLM/TGI prefix/read offsets).

    Each push decodes only a short window of recent tokens, and text that ends in an incomplete
    UTF-8 character is held back until the bytes that complete it arrive.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this are already in the text
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All output text produced so far."""
        return "".join(self._pieces)

    def push(self, new_token_ids: list[int]) -> str:
        """Add output tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_token_ids)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of generation: return any held-back text, incomplete characters included."""
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        # Drop ids before the window so the list stays short however long the output grows.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        self._pieces.append(new_text)
        return new_text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _generation_config_eos_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    return _as_ids(json.loads(path.read_text()).get("eos_token_id"))


def _load(model_dir: Path) -> Any:
    """The tokenizer AutoTokenizer would load from model_dir, without AutoTokenizer's imports where the directory
    names the generic fast tokenizer."""
    try:
        configured = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        configured = None
    if configured in GENERIC_FAST_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
