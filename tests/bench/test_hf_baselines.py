"""The HF transformers baselines run each request to exactly its own output length and time the run."""

from __future__ import annotations

import random
from pathlib import Path

from bench.hf_baselines import run_hf_continuous, run_hf_static
from bench.workload import BenchRequest, RunResult


def test_hf_static_and_continuous_count_each_requests_own_tokens(smollm2_dir: Path) -> None:
    rng = random.Random(0)
    requests = [BenchRequest([rng.randrange(100, 49152) for _ in range(prompt_len)], output_len)
                for prompt_len, output_len in ((16, 3), (20, 5), (18, 4))]
    for result in (run_hf_static(smollm2_dir, requests, batch_size=2, threads=1),
                   run_hf_continuous(smollm2_dir, requests, threads=1)):
        assert isinstance(result, RunResult)
        assert result.useful_tokens == 3 + 5 + 4
        assert result.seconds > 0
