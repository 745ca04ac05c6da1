"""The project root never shadows the standard library: a process started from a checkout (python -m, a peer
router's venv, a tool that puts the root on sys.path) gets the real `operator` module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT


def test_no_top_level_package_is_named_like_a_standard_module() -> None:
    shadowing = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name in sys.stdlib_module_names]
    assert shadowing == [], f"{shadowing} would shadow the standard library for any process run from the root"


def test_a_process_started_at_the_root_imports_the_standard_operator() -> None:
    # -S: no site, so nothing has imported `operator` before the script's own import; the root is sys.path[0]
    out = subprocess.run([sys.executable, "-S", "-c", "import operator; print(operator.__file__, operator.eq(1, 1))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, equal = out.stdout.split()
    assert Path(path).parent != ROOT / "operator" and equal == "True"


def test_the_operator_component_still_imports_as_kvfleet_operator() -> None:
    out = subprocess.run([sys.executable, "-c", "import kvfleet.operator.handlers as h; print(h.__file__)"],
                         cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "operator" / "handlers.py"
