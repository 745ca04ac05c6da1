"""The gateway's view of a prompt's tokens: the engines' own tokenizer and chat template, loaded from the same model
source (`kvfleet gateway --tokenizer MODEL`), so the gateway finds a prompt's blocks in the engines' KV events.

Here, in the composition root, because the gateway must not import the engine. Only a prompt's first
MAX_TOKENIZED_CHARS characters are tokenized (a huge prompt must not stall the gateway): their tokens, less the last
few that the cut may have changed, are the start of the whole prompt's tokens, which is all prefix routing needs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

log = logging.getLogger("kvfleet.gateway")

MAX_TOKENIZED_CHARS = 32_768  # ~8k tokens of English: prefixes longer than this all route alike
CUT_TOKENS = 8  # tokens dropped after a cut: a word split by the cut tokenizes differently from the whole one

Tokenize = Callable[[str, dict], "list[int] | None"]


def prompt_tokenizer(model: str | None) -> Tokenize | None:
    """A tokenize(path, body) for the model, or None (said on stderr) when there is no model or it cannot load."""
    if not model:
        return None
    try:
        from kvfleet.engine.model_files import resolve_model
        from kvfleet.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model(model))
    except Exception as err:  # noqa: BLE001 - any failure to load means: route without it, and say so
        print(f"kvfleet gateway: cannot load the tokenizer of {model!r} ({err}); routing by the approximate prefix "
              "table instead", file=sys.stderr, flush=True)
        return None
    hf = tokenizer._hf  # noqa: SLF001 - the template's text, cut before tokenizing (Tokenizer tokenizes it whole)

    def token_ids(path: str, body: dict) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in body["messages"]]
                if not tokenizer.has_chat_template:
                    return None
                text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                return _encode(tokenizer, text, add_special_tokens=False)
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
