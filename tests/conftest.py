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
