"""The routes SGLang's routers (sglang-router, smg) ask a worker: `GET /server_info` and `/get_server_info` (what it
serves; vLLM-aware routers read the same route for KV-event discovery, so one answer carries both servers' keys),
`GET /model_info` and `/get_model_info` (the model a router registers the worker under), and `GET /get_load` (SGLang's
legacy load shape, one entry per data-parallel rank).

Like /metrics they stay open without the engine token: routers probe them without one and they carry no prompt.
"""

from __future__ import annotations

import time
from importlib.metadata import version

from fastapi import FastAPI

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
LOAD_PATH = "/get_load"
VERSION = version("kvfleet")  # the installed distribution's, as pyproject.toml declares it


def install_sglang_compat_routes(app: FastAPI, state) -> None:  # noqa: ANN001 - api_server.ServerState (no cycle)
    def model_info() -> dict:
        # As an SGLang server started on a local directory: its path, where a router on the same host can read the
        # tokenizer (smg and sglang-router try to load one; elsewhere they warn once and route without it).
        path = str(state.engine.model_dir) if state.engine is not None else state.model_name
        return {"model_path": path, "tokenizer_path": path, "served_model_name": state.model_name,
                "is_generation": True, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "preferred_sampling_params": None,
                "has_image_understanding": False, "has_audio_understanding": False}

    def server_info() -> dict:
        events = state.vllm_kv_events
        info = model_info() | {
            "version": VERSION, "dp_size": 1, "tp_size": 1,
            # vLLM's discovery (vllm-router's kv_aware reads these three)
            "model_id": state.model_name, "instance_id": events.instance_id, "kv_block_size": events.block_size,
            "page_size": events.block_size}
        if state.engine is not None:
            stats = state.engine.stats()
            info |= {"context_length": state.engine.max_model_len, "max_running_requests": stats.max_num_seqs,
                     "max_total_num_tokens": stats.kv_blocks_total * events.block_size}
        return info

    def load() -> list[dict]:
        stats = state.engine.stats() if state.engine is not None else None
        running, waiting = (stats.num_running, stats.num_waiting) if stats else (0, 0)
        used_tokens = (stats.kv_blocks_total - stats.kv_blocks_free) * state.vllm_kv_events.block_size if stats else 0
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                 "num_tokens": used_tokens, "num_pending_tokens": stats.prefill_tokens_pending if stats else 0,
                 "ts_tic": time.perf_counter()}]

    for path in SERVER_INFO_PATHS:
        app.add_api_route(path, server_info, methods=["GET"])
    for path in MODEL_INFO_PATHS:
        app.add_api_route(path, model_info, methods=["GET"])
    app.add_api_route(LOAD_PATH, load, methods=["GET"])
