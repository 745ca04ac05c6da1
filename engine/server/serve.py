"""`kvfleet engine`: the HTTP server answers /health at once, loads and warms the model, then turns /ready true."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import uvicorn

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.api_server import ServerState, build_app
from kvfleet.engine.server.kv_events_zmq import VllmKVEvents, ZmqKVEventPublisher
from kvfleet.engine.server.request_checks import max_prompt_chars
from kvfleet.fleet.http_server import server_config

log = logging.getLogger("kvfleet.engine")
_IMPORTED_AT = time.time()


def _load(config: EngineConfig, state: ServerState, server: uvicorn.Server, url: str, failure: list,
          log_prompts: bool, imports_s: float) -> None:
    try:
        engine = LLMEngine(config)
        if config.kv_events and config.enable_prefix_caching:
            engine.block_manager.events = []  # from the warm-up on, so the first subscriber's snapshot is whole
        # Warm-up: one batch through the model before /ready says yes.
        warming = time.perf_counter()
        engine.generate([[engine.tokenizer.bos_token_id or 0] * 8],
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        startup = {"imports": imports_s, **engine.startup_s, "warmup": time.perf_counter() - warming,
                   "total": time.time() - _process_started()}
        state.metrics.set_startup(startup)
        log.info("started in %.1f s: %s", startup["total"],
                 ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in startup.items() if phase != "total"))
        # the prompt-length bound scans the vocabulary once: here, not on the first request
        log.info("prompts over %d characters are refused before tokenizing",
                 max_prompt_chars(engine.max_model_len, engine.tokenizer.max_token_chars))
    except ValueError as err:  # a configuration the user can fix: say what, no traceback
        print(f"kvfleet: error: {err}", file=sys.stderr)
        failure.append(err)
        server.should_exit = True
        return
    hub = state.kv_events if engine.block_manager.events is not None else None
    state.engine = AsyncEngine(engine, state.metrics, log_prompts, hub)
    print(f"kvfleet engine ready: {url} (model {state.model_name})", file=sys.stderr, flush=True)


def _process_started() -> float:
    """When this process started (epoch seconds): from /proc on Linux, else when this module was imported (after
    the interpreter and most imports: an undercount)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT /ready turns false at once; uvicorn then stops accepting and lets in-flight requests
    finish for up to the drain timeout, which is what a Kubernetes rolling update needs."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001 - signal handler signature
        if not self.state.draining:
            log.info("signal %s: draining in-flight requests (up to %ss)", sig,
                     self.config.timeout_graceful_shutdown)
        self.state.draining = True
        self.state.kv_events.end_all()  # its streams never end by themselves
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down; a finished drain should exit 0 instead.
        self._captured_signals.clear()


def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None = None,
          drain_timeout: float = 30.0, log_prompts: bool = False) -> int:
    state = ServerState(model_name=served_model_name or config.model, kv_events_sse=config.kv_events_sse,
                        vllm_kv_events=VllmKVEvents(config.block_size))
    if config.kv_events_zmq_port is not None and config.kv_events:
        state.vllm_kv_events.publisher = ZmqKVEventPublisher(state.kv_events, host, config.kv_events_zmq_port)
    elif config.kv_events_zmq_port is not None:
        log.warning("--kv-events-zmq-port is ignored: --no-kv-events turns the KV events off")
    app = build_app(state, api_key=config.api_key)
    server = DrainingServer(server_config(app, host, port, drain_timeout), state)
    failure: list = []
    imports_s = time.time() - _process_started()  # the interpreter, torch and the server's modules
    loader = threading.Thread(target=_load, args=(config, state, server, f"http://{host}:{port}", failure, log_prompts,
                                                  imports_s), name="kvfleet-loader", daemon=True)
    loader.start()
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    return 2 if failure else 0


def exit_now(code: int) -> NoReturn:
    """Ends the engine process once serve() has drained and stopped everything: logs and stdio flushed, then
    os._exit. The interpreter's own teardown of torch's modules took 1.2-1.4 s of each engine's exit here (0.5 s
    for `import torch` alone) and frees nothing the OS does not; a rolling update waits for it on every pod."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
