"""How one request is sampled and when it stops, checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling settings, with vLLM's names and defaults.

    temperature 0 means greedy. Invalid values raise ValueError with a message that
    names the field and the allowed range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logprobs: int | None = None  # how many top logprobs to return per token (0-20)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI's)
    skip_special_tokens: bool = True  # special tokens (role markers, EOS) left out of the text
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("n", self.n, low=1, high=128)
        _check_int("top_k", self.top_k, low=0, high=2**31)  # the API bounds it by the vocabulary
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"stop takes at most 16 strings, got {len(self.stop)}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[]", token_id, low=0)
        self.logit_bias = dict(self.logit_bias)
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias key", token_id, low=0)
            _check_float("logit_bias", bias, -100.0, 100.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
