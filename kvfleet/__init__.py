"""kvfleet: LLM serving on Kubernetes with batching at two levels.

This core package holds the fleet contract (kvfleet.fleet), which every component imports, and the composition
root (the CLI and the local fleet), which imports the components; the components (kvfleet.engine,
kvfleet.gateway, kvfleet.operator, kvfleet.kernels) live in the top-level folders and never import each other.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"


def _operator_from_a_checkout() -> None:
    """operator/ has no __init__.py, so a process whose path starts at the project root (python -m from a checkout)
    can never take it for the standard library's `operator`. An installed wheel holds it as kvfleet/operator/, a
    namespace package found the normal way; setuptools' editable finder cannot find a namespace package inside a
    regular one, so from a checkout kvfleet.operator is registered here, pointing at the folder beside this one."""
    here = Path(__file__).resolve().parent
    folder = here.parent / "operator"
    if (here / "operator").is_dir() or not (folder / "handlers.py").is_file() or "kvfleet.operator" in sys.modules:
        return
    spec = importlib.machinery.ModuleSpec("kvfleet.operator", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    sys.modules["kvfleet.operator"] = importlib.util.module_from_spec(spec)


_operator_from_a_checkout()
