"""`kvfleet engine`: the HTTP server answers /health at once, loads and warms the model, then turns /ready true."""

from __future__ import annotations

import logging
import sys
import threading

import uvicorn

from kvfleet.engine.api_server import ServerState, build_app
from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kv_events_zmq import VllmKVEvents, ZmqKVEventPublisher
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.request_checks import max_prompt_chars
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.fleet.http_server import server_config

log = logging.getLogger("kvfleet.engine")


def _load(config: EngineConfig, state: ServerState, server: uvicorn.Server, url: str, failure: list,
          log_prompts: bool) -> None:
    try:
        engine = LLMEngine(config)
        if config.kv_events and config.enable_prefix_caching:
            engine.block_manager.events = []  # from the warm-up on, so the first subscriber's snapshot is whole
        # Warm-up: one batch through the model before /ready says yes.
        engine.generate([[engine.tokenizer.bos_token_id or 0] * 8],
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
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
    loader = threading.Thread(target=_load, args=(config, state, server, f"http://{host}:{port}", failure, log_prompts),
                              name="kvfleet-loader", daemon=True)
    loader.start()
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    return 2 if failure else 0
