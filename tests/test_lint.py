"""The code stays ruff-clean (CONVENTIONS.md), so CI catches what review would."""

from __future__ import annotations

import shutil
import subprocess

from tests.support.paths import ROOT


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff")
    assert ruff, "ruff is a test dependency: pip install -e '.[test]'"
    result = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
