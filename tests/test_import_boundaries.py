"""Components never import each other: engine, gateway, operator and kernels import only the fleet contract
(kvfleet.fleet) and themselves (the engine also runs the kernels), and the contract imports no component.

Every `import` and `from ... import` counts, wherever it stands (inside functions, under TYPE_CHECKING), and
relative imports are resolved. The composition root (kvfleet.cli, kvfleet.local.*, kvfleet.loadgen, ...) is any
other kvfleet module: it may import the components, never the other way round.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

# What each checked package may import of kvfleet.*, besides the standard library and third-party packages.

ALLOWED = {
    "kvfleet.engine": ("kvfleet.engine", "kvfleet.fleet", "kvfleet.kernels"),
    "kvfleet.gateway": ("kvfleet.gateway", "kvfleet.fleet"),
    "kvfleet.operator": ("kvfleet.operator", "kvfleet.fleet"),
    "kvfleet.kernels": ("kvfleet.kernels", "kvfleet.fleet"),
    "kvfleet.fleet": ("kvfleet.fleet",),
}
FOLDERS = {"kvfleet.engine": "engine", "kvfleet.gateway": "gateway", "kvfleet.operator": "operator",
           "kvfleet.kernels": "kernels", "kvfleet.fleet": "kvfleet/fleet"}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the text of `module`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            # `from kvfleet import gateway` imports kvfleet.gateway: name each imported attribute as a module too
            found += [(node.lineno, f"{base}.{alias.name}" if base == "kvfleet" else base) for alias in node.names]
    return sorted(found)


def violations(source: str, module: str, path: str, is_package: bool = False) -> list[str]:
    """`path:line: module imports X` for each kvfleet import outside what module's package may import."""
    owner = next(p for p in ALLOWED if _within(module, p))
    allowed = ALLOWED[owner]
    return [f"{path}:{line}: {module} imports {name} ({owner} may import only {', '.join(allowed)})"
            for line, name in imported_modules(source, module, is_package)
            if _within(name, "kvfleet") and not any(_within(name, a) for a in allowed)]


def checked_files() -> list[tuple[Path, str, bool]]:
    """(file, module name, is a package's __init__) for every Python file of the checked packages."""
    files = []
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            module = ".".join((package, *(parts[:-1] if is_package else parts)))
            files.append((path, module, is_package))
    return files


def test_no_component_imports_another_component_or_the_composition_root() -> None:
    found = []
    for path, module, is_package in checked_files():
        found += violations(path.read_text(), module, str(path.relative_to(ROOT)), is_package)
    assert found == [], "imports across component boundaries:\n" + "\n".join(found)


def test_every_checked_package_has_files() -> None:
    modules = {module for _, module, _ in checked_files()}
    for package in FOLDERS:
        assert any(_within(m, package) for m in modules), f"no Python files found for {package}"


def test_the_checker_names_file_and_line_of_each_crossing() -> None:
    source = ("import os\n"
              "from kvfleet.fleet.metrics import KV_CACHE_USAGE\n"
              "from kvfleet.kernels import attention\n"
              "def late():\n"
              "    from kvfleet.gateway.routing.pick import pick\n"
              "    import kvfleet.local.fleet\n"
              "from .. import cli\n"
              "from kvfleet import operator\n")
    assert violations(source, "kvfleet.engine.scheduler", "engine/scheduler.py") == [
        "engine/scheduler.py:5: kvfleet.engine.scheduler imports kvfleet.gateway.routing.pick "
        "(kvfleet.engine may import only kvfleet.engine, kvfleet.fleet, kvfleet.kernels)",
        "engine/scheduler.py:6: kvfleet.engine.scheduler imports kvfleet.local.fleet "
        "(kvfleet.engine may import only kvfleet.engine, kvfleet.fleet, kvfleet.kernels)",
        "engine/scheduler.py:7: kvfleet.engine.scheduler imports kvfleet.cli "
        "(kvfleet.engine may import only kvfleet.engine, kvfleet.fleet, kvfleet.kernels)",
        "engine/scheduler.py:8: kvfleet.engine.scheduler imports kvfleet.operator "
        "(kvfleet.engine may import only kvfleet.engine, kvfleet.fleet, kvfleet.kernels)",
    ]


def test_the_checker_holds_the_contract_and_the_kernels_to_their_own_rules() -> None:
    assert violations("from kvfleet.engine.config import EngineConfig\n", "kvfleet.fleet.limits", "f.py")
    assert violations("from kvfleet.kernels import x\n", "kvfleet.gateway.app", "g.py")
    assert violations("import kvfleet.engine\n", "kvfleet.kernels.attention", "k.py")
    assert violations("from . import handlers\n", "kvfleet.operator", "operator/__init__.py", is_package=True) == []
    assert violations("from .config import X\n", "kvfleet.gateway.app", "g.py") == []


def test_the_engine_core_never_imports_its_http_side() -> None:
    """engine/server/ (the HTTP API and the process) calls the core through AsyncEngine; the core runs without it
    (`kvfleet chat`, LLMEngine from Python)."""
    found = [f"{path.relative_to(ROOT)}:{line}: {module} imports {name}"
             for path, module, is_package in checked_files()
             if _within(module, "kvfleet.engine") and not _within(module, "kvfleet.engine.server")
             for line, name in imported_modules(path.read_text(), module, is_package)
             if _within(name, "kvfleet.engine.server")]
    assert found == [], "\n".join(found)
