"""The Anyscale-style batch workload shared by every system in the benchmark."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate, EOS ignored


@dataclass
class RunResult:
    name: str
    seconds: float
    useful_tokens: int  # each request's own output tokens only
    extra: dict

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def anyscale_workload(num_requests: int = 64, seed: int = 0, vocab_size: int = 49152, prompt_min: int = 16,
                      prompt_max: int = 256, mean_output: int = 64, max_output: int = 256) -> list[BenchRequest]:
    """Prompt lengths uniform in [prompt_min, prompt_max]; output lengths exponential (mean 64) capped at 256."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(prompt_min, prompt_max)
        # Ids from the ordinary vocabulary (past the special tokens) so no prompt ends early or shares a prefix.
        prompt = [rng.randrange(100, vocab_size) for _ in range(prompt_len)]
        output_len = min(max_output, max(1, round(rng.expovariate(1 / mean_output))))
        requests.append(BenchRequest(prompt, output_len))
    return requests
