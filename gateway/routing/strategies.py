"""The one registry of routing strategies: `--routing` offers exactly these names, in this order."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from kvfleet.gateway.routing.pick import (
    LeastRequest,
    RoundRobin,
    SaturationPolicy,
    ScoreWeights,
    Strategy,
    WeightedScoring,
)
from kvfleet.gateway.routing.scorers import KVHeadroom, LoraAffinity, PrefixMatch, QueueRoom
from kvfleet.gateway.routing.ttft import EstimatedTTFT, PrefixAffinity


def weighted_scoring(weights: ScoreWeights, policy: SaturationPolicy) -> Strategy:
    return WeightedScoring(((weights.queue, QueueRoom(policy.max_queue)), (weights.kv, KVHeadroom()),
                            (weights.prefix, PrefixMatch()), (weights.lora, LoraAffinity())), policy)


STRATEGIES: dict[str, Callable[[ScoreWeights, SaturationPolicy], Strategy]] = {
    "kvfleet": weighted_scoring,
    "least-request": lambda weights, policy: LeastRequest(policy),
    "round-robin": lambda weights, policy: RoundRobin(),
    "estimated-ttft": lambda weights, policy: EstimatedTTFT(policy),
    "prefix-affinity": lambda weights, policy: PrefixAffinity(policy, ttft=EstimatedTTFT(policy)),
}
# The strategies that read a prompt's prefix (the gateway computes its keys and follows KV events only for these).
PREFIX_STRATEGIES = frozenset({"kvfleet", "estimated-ttft", "prefix-affinity"})


@cache
def strategy_named(name: str, weights: ScoreWeights = ScoreWeights(),
                   policy: SaturationPolicy = SaturationPolicy()) -> Strategy:
    """The registered strategy called name, built once per setting."""
    if name not in STRATEGIES:
        raise ValueError(f"--routing must be one of {', '.join(STRATEGIES)}, not {name!r}")
    return STRATEGIES[name](weights, policy)
