"""The gateway's one token estimate (gateway/token_estimate.py): what the tokens-per-minute limit reserves, what
routing takes a prompt it does not tokenize to cost, and what a batch's lines are planned as are the same numbers."""

from __future__ import annotations

import pytest

from kvfleet.fleet.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS
from kvfleet.gateway.batch.lines import token_estimate
from kvfleet.gateway.prefix.worth import PrefixRouting
from kvfleet.gateway.token_estimate import DEFAULT_CHAT_MAX_TOKENS, MAX_RESERVATION, Cost, request_cost


def test_a_request_costs_its_prompt_estimate_plus_its_output_allowance_for_every_choice() -> None:
    assert request_cost({"prompt": "x" * 40, "max_tokens": 50, "n": 3}) == Cost(prompt=10, completion=150)
    assert request_cost({"prompt": ["x" * 8, "y" * 4], "max_tokens": 5, "n": 2}) == Cost(prompt=3, completion=20)
    assert request_cost({"prompt": [1, 2, 3, 4, 5], "max_tokens": 7}) == Cost(prompt=5, completion=7)
    assert request_cost({"prompt": "é" * 4, "max_tokens": 1}) == Cost(prompt=2, completion=1)  # UTF-8 bytes
    chat = {"messages": [{"role": "user", "content": "z" * 16}], "max_tokens": 9, "max_completion_tokens": 3}
    assert request_cost(chat) == Cost(prompt=4 + 4 + 4, completion=3)  # max_completion_tokens wins, as OpenAI's
    # without a limit: what the engine would allow, OpenAI's 16 for a completion, the context (reserved) for a chat
    assert request_cost({"prompt": "hi"}).completion == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert request_cost({"messages": [{"role": "user", "content": "hi"}]}).completion == DEFAULT_CHAT_MAX_TOKENS
    # wrong types are the schema's to refuse (400); the estimate must only not break on them
    assert request_cost({"prompt": 5, "max_tokens": "4", "n": True}) == Cost(0, COMPLETIONS_DEFAULT_MAX_TOKENS)
    assert request_cost({"prompt": "hi", "max_tokens": 10**15, "n": 10**6}).tokens == MAX_RESERVATION


@pytest.mark.parametrize("body", [
    {"prompt": "Once upon a time " * 40, "max_tokens": 64},
    {"prompt": "Le café crème, s'il vous plaît. " * 12},
    {"prompt": [101, 2023, 2003, 1037], "max_tokens": 3},
    {"messages": [{"role": "system", "content": "You answer for the ferry office. " * 8},
                  {"role": "user", "content": [{"type": "text", "text": "Is there a late boat?"}]}]},
])
def test_limits_routing_and_the_batch_plan_count_the_same_tokens(body: dict) -> None:
    cost = request_cost(body)
    assert token_estimate(body) == (cost.prompt, cost.completion)  # a batch line, as the autoscaler plans it
    assert PrefixRouting().keys("/v1/completions", body).est_tokens == cost.prompt  # routing, untokenized
