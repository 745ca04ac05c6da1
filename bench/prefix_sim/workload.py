"""The simulated traffic: T tenants, each a distinct system prompt (its own token ids) plus a short question, picked
with Zipf popularity and arriving as a Poisson process at a set rate."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

VOCAB = 49_152  # SmolLM2's vocabulary: token ids stay in its range


@dataclass(frozen=True)
class WorkloadShape:
    tenants: int = 1000
    system_tokens: tuple[int, int] = (300, 1500)  # each tenant's system prompt length, uniform
    question_tokens: tuple[int, int] = (20, 60)
    output_tokens: tuple[int, int] = (16, 64)
    zipf_s: float = 1.0  # tenant k (from 1) is picked with weight 1 / k**s

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.zipf_s < 0:
            raise ValueError("tenants must be >= 1 and zipf_s >= 0")
        for low, high in (self.system_tokens, self.question_tokens, self.output_tokens):
            if not 1 <= low <= high:
                raise ValueError("token ranges are (low, high) with 1 <= low <= high")

    @property
    def mean_prompt_tokens(self) -> float:
        return (sum(self.system_tokens) + sum(self.question_tokens)) / 2

    @property
    def mean_question_tokens(self) -> float:
        return sum(self.question_tokens) / 2

    @property
    def mean_output_tokens(self) -> float:
        return sum(self.output_tokens) / 2


@dataclass(frozen=True, slots=True)
class Arrival:
    rid: int
    at: float
    tenant: int
    token_ids: tuple[int, ...]
    output_tokens: int
    first_of_tenant: bool  # the tenant's first request in the trace: a miss under any policy


def tenant_prompts(shape: WorkloadShape, seed: int) -> list[tuple[int, ...]]:
    """Each tenant's system prompt: its own random token ids (no two tenants share a leading block)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(*shape.system_tokens))) for _ in range(shape.tenants)]


def poisson_trace(shape: WorkloadShape, rate: float, duration_s: float, seed: int,
                  ramp_s: float = 0.0) -> list[Arrival]:
    """Arrivals at `rate` requests/s for duration_s seconds, rising linearly from a quarter of it over the first
    ramp_s seconds (cold caches: every tenant's first request is a miss, and a fleet hit by its full rate while
    cold never works off the backlog); the same seed gives the same trace for every policy."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(seed + 1)
    prompts = tenant_prompts(shape, seed)
    cumulative = list(itertools.accumulate(1.0 / (k + 1) ** shape.zipf_s for k in range(shape.tenants)))
    population = range(shape.tenants)
    out: list[Arrival] = []
    seen: set[int] = set()
    at = rng.expovariate(rate)
    while at < duration_s:
        if at < ramp_s and rng.random() > 0.25 + 0.75 * at / ramp_s:
            at += rng.expovariate(rate)
            continue
        tenant = rng.choices(population, cum_weights=cumulative)[0]
        question = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(*shape.question_tokens)))
        out.append(Arrival(len(out), at, tenant, prompts[tenant] + question, rng.randint(*shape.output_tokens),
                           tenant not in seen))
        seen.add(tenant)
        at += rng.expovariate(rate)
    return out
