"""The wheel holds the whole package: every module of every folder pyproject maps into kvfleet.*, importable and
runnable from a non-editable install. An editable install finds modules in the checkout, so it hid a wheel without
kvfleet/plan/: the images' `pip install /src` shipped a `kvfleet plan` command with no module behind it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import ROOT


def package_dir() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def modules_in_the_tree() -> set[str]:
    """The files a wheel must hold, as wheel paths: each .py under each folder pyproject's package-dir maps."""
    return {"/".join([*name.split("."), *py.relative_to(ROOT / folder).parts])
            for name, folder in package_dir().items() for py in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in py.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of what an image's build context holds: setuptools would reuse a checkout's stale build/."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for top in {folder.split("/")[0] for folder in package_dir().values()}:
        shutil.copytree(ROOT / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [built] = out.glob("kvfleet-*.whl")
    return built


def test_the_wheel_holds_every_module_of_the_tree(wheel: Path) -> None:
    held = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(modules_in_the_tree() - held)
    assert not missing, f"in the tree but not in the wheel (pyproject's [tool.setuptools] packages): {missing}"
    assert "kvfleet/local/vllm_constraints_cpu.txt" in held  # `kvfleet vllm install` pins the vLLM venv by it


def test_an_installed_wheel_imports_every_module_and_runs_its_commands(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    modules = sorted(p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                     for p in zipfile.ZipFile(wheel).namelist() if p.endswith(".py"))
    # -S: no .pth files, so the checkout's editable finder cannot stand in for what the wheel lacks; the
    # dependencies come from this environment's site-packages, named on the path after the wheel's copy
    path = f"{target}:{sysconfig.get_paths()['purelib']}"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", *args], env={"PYTHONPATH": path, "HOME": str(tmp_path)},
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)

    check = (f"import importlib\nmodules, target = {modules!r}, {str(target)!r}\n"
             "outside = [m for m in modules if not importlib.import_module(m).__file__.startswith(target)]\n"
             "assert not outside, outside")
    imported = run("-c", check)
    assert imported.returncode == 0, imported.stderr[-3000:]
    for command in (["plan", "--help"], ["bench", "autoscale", "--help"]):
        ran = run("-m", "kvfleet.cli", *command)
        assert ran.returncode == 0 and ran.stdout.startswith(f"usage: kvfleet {' '.join(command[:-1])}"), ran.stderr
