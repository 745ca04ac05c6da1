"""The gateway's view of a prompt's tokens: the engines' own tokenizer and chat template, loaded from the same model
source (`kvfleet gateway --tokenizer MODEL`), so the gateway finds a prompt's blocks in the engines' KV events.

Here, in the composition root, because the gateway must not import the engine. Tokenizing costs ~2 µs a token on
this machine's CPU, on the gateway's hot path, so two bounds: only a prompt's first MAX_TOKENIZED_CHARS characters
are tokenized (their tokens, less the last few the cut may have changed, are the start of the whole prompt's tokens,
which is all prefix routing needs), and a rendered chat is tokenized piece by piece between its special tokens (as
the tokenizer itself splits it), long pieces remembered: a tenant's system prompt is tokenized once, then only each
new question. The piecewise result is checked against the whole-text tokenization when loaded, and not used for a
tokenizer where they differ.
"""

from __future__ import annotations

import logging
import re
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger("kvfleet.gateway")

MAX_TOKENIZED_CHARS = 32_768  # ~8k tokens of English: prefixes longer than this all route alike
CUT_TOKENS = 8  # tokens dropped after a cut: a word split by the cut tokenizes differently from the whole one
CACHED_PIECE_CHARS = 256  # shorter pieces (role names, questions) are cheap to tokenize again
CACHED_PIECES = 1024  # at most 1024 x 32k characters and their tokens (~64 MiB) remembered

Tokenize = Callable[[str, dict], "list[int] | None"]


def prompt_tokenizer(model: str | None) -> Tokenize | None:
    """A tokenize(path, body) for the model, or None (said on stderr) when there is no model or it cannot load."""
    if not model:
        return None
    try:
        from kvfleet.engine.model_files import resolve_tokenizer
        from kvfleet.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_tokenizer(model))
    except Exception as err:  # noqa: BLE001 - any failure to load means: route without it, and say so
        print(f"kvfleet gateway: cannot load the tokenizer of {model!r} ({err}); routing by the approximate prefix "
              "table instead", file=sys.stderr, flush=True)
        return None
    hf = tokenizer._hf  # noqa: SLF001 - the template's text, cut before tokenizing (Tokenizer tokenizes it whole)
    pieces = PieceTokenizer(hf)
    encode_chat = pieces.encode if pieces.agrees_with(hf) else (lambda text: hf.encode(text, add_special_tokens=False))

    def token_ids(path: str, body: dict) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in body["messages"]]
                if not tokenizer.has_chat_template:
                    return None
                text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                if len(text) <= MAX_TOKENIZED_CHARS:
                    return encode_chat(text)
                return encode_chat(text[:MAX_TOKENIZED_CHARS])[:-CUT_TOKENS]
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch: its first prompt decides
            if isinstance(prompt, str):
                return _encode(tokenizer, prompt, add_special_tokens=True)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception:  # noqa: BLE001 - a prompt the template or tokenizer refuses routes without its tokens
            log.debug("could not tokenize a prompt for routing", exc_info=True)
        return None

    return token_ids


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:  # noqa: ANN001 - engine Tokenizer
    if len(text) <= MAX_TOKENIZED_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode(text[:MAX_TOKENIZED_CHARS], add_special_tokens=add_special_tokens)[:-CUT_TOKENS]


def _text(content: object) -> str:
    """A message's text as the engine reads it: a string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


class PieceTokenizer:
    """Whole-text tokenization by pieces: the text split at the tokenizer's added (special) tokens, each piece
    tokenized alone, long ones remembered (LRU)."""

    def __init__(self, hf) -> None:  # noqa: ANN001 - a transformers fast tokenizer
        self.backend = hf.backend_tokenizer
        self.added = dict(hf.get_added_vocab())
        names = sorted(self.added, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")").split if names else None
        self.cache: OrderedDict[str, array] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        if self.split is None:
            return self._piece(text)
        out: list[int] = []
        for i, piece in enumerate(self.split(text)):
            if i % 2:
                out.append(self.added[piece])
            elif piece:
                out += self._piece(piece)
        return out

    def _piece(self, piece: str) -> list[int]:
        if len(piece) < CACHED_PIECE_CHARS:
            return self.backend.encode(piece, add_special_tokens=False).ids
        ids = self.cache.get(piece)
        if ids is None:
            # 4 bytes a token, not a list's ~36: clients choose what fills this cache
            ids = self.cache[piece] = array("I", self.backend.encode(piece, add_special_tokens=False).ids)
            if len(self.cache) > CACHED_PIECES:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(piece)
        return ids.tolist()

    def agrees_with(self, hf) -> bool:  # noqa: ANN001
        """Whether pieces give the whole text's tokens on a few conversations (added tokens with lstrip/rstrip or a
        normalizer could make them differ)."""
        samples = [[{"role": "system", "content": "You are  helpful.\n\n Answer " * 40},
                    {"role": "user", "content": " Hi there!  "}],
                   [{"role": "user", "content": "x" * 300 + " <b>bold</b>\t\ttabs"},
                    {"role": "assistant", "content": "  ok  "}, {"role": "user", "content": "é ü 日本 🙂"}]]
        try:
            texts = [hf.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in samples]
        except Exception:  # noqa: BLE001 - no template: chats are not tokenized at all
            return False
        return all(self.encode(t) == hf.encode(t, add_special_tokens=False) for t in texts)
