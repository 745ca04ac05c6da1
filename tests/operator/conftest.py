"""The operator's fixtures: an emulated Kubernetes API with operators started and restarted against it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvfleet.local.kube_emulator import KubeEmulator
from tests.support.kmock import start_operator


@pytest.fixture
def cluster(tmp_path: Path):
    """(the emulator's API client, the operators started so far, a call that starts one more); all stopped after."""
    emulator = KubeEmulator().start()
    kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig.json")
    operators: list[subprocess.Popen] = []
    yield emulator.api_client(), operators, lambda: operators.append(start_operator(kubeconfig,
                                                                                   tmp_path / "operator.log"))
    for operator in operators:
        operator.kill()
        operator.wait(timeout=30)
    emulator.stop()
