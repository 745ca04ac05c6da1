"""`--dtype auto` on a CPU: bfloat16 where the CPU has bfloat16 instructions (kvfleet's engine served 1.5x its float32
tokens/s there), float32 elsewhere (bfloat16 would be emulated, slower); the start-up log says which and why.
$KVFLEET_DTYPE is the flag's default (the suite sets float32 in conftest.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from kvfleet.engine.cli_args import add_engine_args
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.fleet.cpu_features import auto_cpu_dtype, host_cpu_flags
from kvfleet.fleet.engine_settings import DTYPE_ENV
from tests.conftest import make_engine


def test_auto_runs_bfloat16_where_the_cpu_has_bfloat16_instructions() -> None:
    dtype, why = auto_cpu_dtype(frozenset({"avx2", "avx512f", "avx512_bf16"}), onednn_bf16=True)
    assert dtype == "bfloat16" and "avx512_bf16" in why and "--dtype float32" in why
    assert auto_cpu_dtype(frozenset({"amx_bf16", "amx_tile", "avx512_bf16"}), onednn_bf16=True)[0] == "bfloat16"


@pytest.mark.parametrize(("flags", "onednn_bf16", "reason"), [
    (frozenset({"avx2", "fma", "avx512f"}), True, "no bfloat16 instructions"),
    (frozenset({"avx512_bf16"}), False, "oneDNN"),
    (None, True, "/proc/cpuinfo"),
])
def test_auto_runs_float32_where_bfloat16_would_be_emulated_or_nobody_can_say(flags: frozenset[str] | None,
                                                                           onednn_bf16: bool, reason: str) -> None:
    dtype, why = auto_cpu_dtype(flags, onednn_bf16)
    assert dtype == "float32" and reason in why


def test_the_engine_runs_in_the_dtype_auto_chooses_here_and_its_log_says_why(tiny_model_dir: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvfleet.engine"):
        engine = make_engine(tiny_model_dir, dtype="auto")
    expected, why = auto_cpu_dtype(host_cpu_flags(), torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert engine.dtype == getattr(torch, expected)
    assert {p.dtype for p in engine.model.parameters()} == {engine.dtype}
    assert f"dtype: {expected} (auto: {why})" in caplog.text
    [answer] = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert answer.num_output_tokens == 4


def test_kvfleet_dtype_in_the_environment_is_the_flags_default(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        return parser.parse_args(list(argv)).dtype

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    assert parse() == "bfloat16" and parse("--dtype", "float32") == "float32"
    monkeypatch.delenv(DTYPE_ENV)
    assert parse() == "auto"


def test_a_dtype_the_engine_does_not_know_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, float16, bfloat16"):
        EngineConfig(dtype="bf16")
