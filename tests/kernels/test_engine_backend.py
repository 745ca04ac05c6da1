"""`--attention-backend`: which backend the engine picks, and the Triton one generating what the torch one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.attention_select import choose_attention_backend
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams
from tests.conftest import make_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("device,installed,expected", [
    (CUDA, True, "triton"), (CUDA, False, "torch"), (CPU, True, "torch"), (CPU, False, "torch"),
])
def test_auto_takes_triton_on_cuda_when_installed(device: torch.device, installed: bool, expected: str) -> None:
    assert choose_attention_backend("auto", device, installed, triton_interpreting=False) == expected


def test_explicit_choices_are_kept_where_they_can_run() -> None:
    assert choose_attention_backend("torch", CUDA, triton_installed=True, triton_interpreting=False) == "torch"
    assert choose_attention_backend("triton", CUDA, triton_installed=True, triton_interpreting=False) == "triton"
    assert choose_attention_backend("triton", CPU, triton_installed=True, triton_interpreting=True) == "triton"


def test_triton_without_the_package_says_how_to_get_it() -> None:
    with pytest.raises(ValueError, match="pip install triton.*--attention-backend torch"):
        choose_attention_backend("triton", CUDA, triton_installed=False, triton_interpreting=False)


def test_triton_on_cpu_without_the_interpreter_is_refused_before_loading(tiny_model_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 .* or use --attention-backend torch"):
        make_engine(tiny_model_dir, attention_backend="triton")


def greedy_tokens(engine: LLMEngine, waves: list[list[list[int]]]) -> list[list[int]]:
    """Each wave's prompts submitted together and run to the end, wave after wave; the tokens of each prompt."""
    tokens: dict[str, list[int]] = {}
    for wave_index, prompts in enumerate(waves):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{wave_index}-{i}", prompt, GREEDY)
            tokens[f"{wave_index}-{i}"] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                tokens[out.request_id].extend(out.new_token_ids)
    return list(tokens.values())


def test_triton_backend_generates_the_torch_backends_greedy_tokens(tiny_model_dir: Path) -> None:
    """Chunked prefill (32-token budget), decodes beside prefill chunks, and a second wave that hits the prefix
    cache, in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 40000, (40,), generator=generator).tolist()
    waves = [
        [shared + [7, 8, 9], [42], torch.randint(100, 40000, (70,), generator=generator).tolist()],
        [shared + [10, 11], shared[:17]],  # 2 and 1 full cached blocks of 16
    ]
    results = {}
    for backend in ("torch", "triton"):
        engine = make_engine(tiny_model_dir, attention_backend=backend, max_num_batched_tokens=32)
        assert engine.attention_backend == backend
        results[backend] = greedy_tokens(engine, waves)
        assert engine.stats().prefix_cache_hits > 0
    assert results["triton"] == results["torch"]
    assert all(len(tokens) == GREEDY.max_tokens for tokens in results["triton"])
