"""The gateway's one estimate of a request's tokens before an engine has counted them: what the tokens-per-minute
limit reserves (limits/), what routing takes a prompt's prefill to cost where the gateway does not tokenize it
(prefix/worth.py), and what a batch's lines are planned as (batch/: the autoscaler's backlog). Pure.

A prompt is its UTF-8 bytes / 4 (English runs about four bytes a token in a BPE vocabulary; token ids count
exactly), plus a few tokens per chat message for the template. The output is what the request allows: its
max_completion_tokens or max_tokens, else what the engine would allow, which for a completion is OpenAI's default of
16 (the engines apply it too) and for a chat its context, reserved as DEFAULT_CHAT_MAX_TOKENS. An answer's real count
(its usage) replaces the estimate when it settles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.fleet.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS

BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
# A chat without max_tokens may run to the engine's context length: reserved as this many per choice.
DEFAULT_CHAT_MAX_TOKENS = 1024
MAX_RESERVATION = 10**12  # keeps absurd max_tokens x n within Redis's 64-bit integers


@dataclass(frozen=True)
class Cost:
    """A request's estimate: its prompts' tokens and the most it may generate (every prompt and choice)."""

    prompt: int
    completion: int

    @property
    def tokens(self) -> int:
        return min(MAX_RESERVATION, self.prompt + self.completion)


def request_cost(body: dict) -> Cost:
    """The estimate for a request body: its prompts' tokens, and its output allowance x choices x prompts."""
    prompts = prompt_tokens(body)
    choices = _positive_int(body.get("n"), 1)
    return Cost(prompt=sum(prompts),
                completion=min(MAX_RESERVATION, max_output_tokens(body) * choices * len(prompts)))


def max_output_tokens(body: dict) -> int:
    """The most one choice may generate: max_completion_tokens, else max_tokens, else the engine's default."""
    limit = body.get("max_completion_tokens")
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if "prompt" in body else DEFAULT_CHAT_MAX_TOKENS
    return _positive_int(limit if limit is not None else body.get("max_tokens"), default)


def prompt_tokens(body: dict) -> list[int]:
    """Estimated tokens of each prompt the request holds (chat: one; completions: one per listed prompt)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
            total += TOKENS_PER_MESSAGE + (text_tokens(content) if isinstance(content, str) else 0)
        return [total + TOKENS_PER_MESSAGE]  # the assistant turn's header
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [text_tokens(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [len(prompt)]  # token ids: exact
    if isinstance(prompt, list) and prompt:
        return [text_tokens(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 0 for p in prompt]
    return [0]


def text_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN)


def _positive_int(value: object, default: int) -> int:
    # Wrong types are the strict schema's to refuse; here they only must not break the estimate.
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
