"""kvfleet's command line, run as a user runs it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def capacity_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfleet.cli", "bench", "capacity", *args], capture_output=True,
                          text=True, timeout=600)


def start_up(model_dir, port: int, engines: int = 2, *more_models: str,
             extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, list[str]]:
    models = [flag for m in (str(model_dir), *more_models) for flag in ("--model", m)]
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.cli", "up", "--engines", str(engines), *models,
                             "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "16MiB", *extra],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"kvfleet up exited with {proc.wait()}: {''.join(lines)}")
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            return proc, lines
    proc.kill()
    raise AssertionError("kvfleet up did not come up: " + "".join(lines))


def listening(url: str) -> bool:
    host, port = url.removeprefix("http://").removeprefix("redis://").split("/")[0].split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0
