"""Fixtures shared by the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.model_files import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct in the default cache (converted once per machine)."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random-weight 3-layer Llama with grouped-query attention and SmolLM2's tokenizer."""
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def make_engine(model_dir: Path, **overrides: object):
    """An engine on a local model with small, test-friendly defaults."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    settings: dict = dict(model=str(model_dir), max_model_len=256, kv_cache_memory="8MiB", max_num_seqs=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), show_progress=False)


@pytest.fixture
def tiny_engine(tiny_model_dir: Path):
    return make_engine(tiny_model_dir)
