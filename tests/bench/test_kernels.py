"""bench/kernels.py's CPU path (one tiny size in Triton's interpreter) runs, so the GPU benchmark cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kernels import main


def test_cpu_run_reports_both_backends_agreeing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--out", str(tmp_path)])
    assert "Triton interpreter" in capsys.readouterr().out
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert len(rows) == 1
    assert rows[0]["triton_ms"] > 0 and rows[0]["torch_ms"] > 0
    assert rows[0]["max_abs_diff"] <= 1e-4


def test_the_cpu_decode_kernel_bench_times_the_kernel_and_checks_it_against_the_reference(capsys) -> None:
    from bench import cpu_decode_kernel

    cpu_decode_kernel.main(["--rounds", "2", "--sequences", "3", "--layers", "2"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("2 calls: median ") and "ms, best " in line
    assert float(line.rsplit("reference ", 1)[1].rstrip(")")) < 0.01
