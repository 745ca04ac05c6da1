"""The project root never shadows the standard library: a process started from a checkout (python -m, a peer
router's venv, a tool that puts the root on sys.path) gets the real `operator` module. Test files share helpers
through tests/support/, never by importing each other."""

from __future__ import annotations

import ast
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


def test_no_test_module_imports_another_test_module() -> None:
    """Shared helpers live in tests/support/ (or a conftest's fixtures): a test file imported by another drags its
    fixtures and its module-scoped engines along, and hides where a helper is defined."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "e2e").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}" for name in names
                      if name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")]
    assert found == [], "\n".join(found)
