"""The Helm chart rendered by the real helm binary, and the pieces of it the tests look at."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from kvfleet.cli import build_parser
from kvfleet.operator.fleet_spec import parse_fleet
from kvfleet.operator.manifests import build_deployment
from tests.support.paths import CHART, ROOT

RELEASE, NAMESPACE = "kv", "llm"
# The Kubernetes version the manifests are rendered for and validated against (the chart needs >= 1.29).
KUBE_VERSION = "1.33.0"


@cache
def helm() -> str:
    found = shutil.which("helm")
    if found:
        return found
    if not shutil.which("npm"):
        pytest.skip("helm is not on PATH and npm is missing, so scripts/fetch-helm.sh cannot fetch it")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "fetch-helm.sh")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"scripts/fetch-helm.sh failed:\n{done.stderr}"
    return done.stdout.strip().splitlines()[-1]


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)


def template_args(values_file: Path | None = None, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values_file is not None:
        args += ["-f", str(values_file)]
    for s in sets:
        args += ["--set", s]
    return args


@cache
def render(values_file: Path | None = None, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    done = run_helm(*template_args(values_file, sets))
    assert done.returncode == 0, f"helm template failed for {values_file}:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def find(docs, kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind: str, name: str) -> dict:
    [doc] = find(docs, kind, name)
    return doc


def container(docs, deployment: str) -> dict:
    return one(docs, "Deployment", f"{RELEASE}-kvfleet-{deployment}")["spec"]["template"]["spec"]["containers"][0]


def parse_cli(c: dict) -> tuple[object, dict]:
    """The container's command line parsed by the real `kvfleet` parser, with $(VAR) references resolved."""
    assert c["command"] == ["kvfleet"]
    env = {e["name"]: e for e in c.get("env", [])}
    args = []
    for arg in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{arg} refers to an env var the container lacks"
            arg = arg.replace(f"$({var})", f"<{var}>")
        args.append(arg)
    return build_parser().parse_args(args), env


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def engine_pod(docs, fleet_name: str = "chat", namespace: str = NAMESPACE) -> dict:
    """The engine pod template the operator (run with the rendered flags) creates for a fleet."""
    op_args, _ = parse_cli(container(docs, "operator"))
    fleet = parse_fleet(fleet_name, namespace, {"model": "smollm2-135m-instruct"}, op_args.engine_api_key_secret)
    return build_deployment(fleet, 1)["spec"]["template"]
