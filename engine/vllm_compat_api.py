"""The routes a vLLM-aware router asks a vLLM pod before it routes by KV events: `GET /kv_event_sources` (where the
ZMQ publisher listens), `GET /get_server_info` (model, instance, block size) and the render routes
`POST /v1/completions/render`, `POST /v1/chat/completions/render` (the token ids this engine would run, so a router
that does not tokenize itself, as vllm-router's kv_aware over HTTP, can match them against the events).

The discovery routes stay open like /metrics (vllm-router sends no token; they carry no prompt); render sits under
/v1/ and needs the engine token when one is set.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from kvfleet.engine.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet.engine.request_checks import check_prompt_chars
from kvfleet.fleet.errors import APIError

KV_EVENT_SOURCES_PATH = "/kv_event_sources"
SERVER_INFO_PATH = "/get_server_info"
MAX_PROMPTS = 64  # as /v1/completions


def install_vllm_compat_routes(app: FastAPI, state) -> None:  # noqa: ANN001 - api_server.ServerState (no cycle)
    @app.get(KV_EVENT_SOURCES_PATH)
    async def kv_event_sources(request: Request) -> dict:
        publisher = state.vllm_kv_events.publisher
        if publisher is None or not publisher.endpoint:
            return {}  # as a vLLM pod with KV events off: no sources
        return publisher.sources(request.url.hostname or "")

    @app.get(SERVER_INFO_PATH)
    async def server_info() -> dict:
        events = state.vllm_kv_events
        return {"model_id": state.model_name, "instance_id": events.instance_id, "kv_block_size": events.block_size}

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict]:
        engine = state.require_engine()
        tokenizer = engine.engine.tokenizer
        prompts = [body.prompt] if isinstance(body.prompt, str) or not body.prompt or isinstance(
            body.prompt[0], int) else list(body.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), engine.engine.max_model_len, tokenizer.max_token_chars,
                                   f"prompt.{i}")
                prompt = await asyncio.to_thread(tokenizer.encode, prompt)
            out.append(_rendered(state.model_name, list(prompt)))
        return out

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict:
        engine = state.require_engine()
        tokenizer = engine.engine.tokenizer
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            check_prompt_chars(sum(len(m["content"]) for m in messages), engine.engine.max_model_len,
                               tokenizer.max_token_chars, "messages")
            token_ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        return _rendered(state.model_name, token_ids)


def _rendered(model: str, token_ids: list[int]) -> dict:
    """vLLM's GenerateRequest as its render routes answer it (routers read token_ids)."""
    return {"request_id": f"render-{uuid.uuid4().hex}", "model": model, "token_ids": token_ids,
            "sampling_params": {}}
