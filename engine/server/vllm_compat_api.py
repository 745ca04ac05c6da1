"""The routes a vLLM-aware router asks a vLLM pod: `GET /kv_event_sources` (where the ZMQ publisher listens), the
render routes `POST /v1/completions/render`, `POST /v1/chat/completions/render` (the token ids this engine would run,
so a router that does not tokenize itself, as vllm-router's kv_aware over HTTP, can match them against the events),
and `POST /tokenize`, `POST /detokenize` (vllm-router's prefix-aware policies tokenize every request this way).
`GET /get_server_info` answers for vLLM and SGLang alike (sglang_compat_api).

The discovery route stays open like /metrics (vllm-router sends no token; it carries no prompt); render, tokenize
and detokenize carry prompts and need the engine token when one is set.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from kvfleet.engine.server.lora_api import requested_adapter
from kvfleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvfleet.engine.server.request_checks import check_prompt_chars
from kvfleet.engine.server.sglang_compat_api import VERSION
from kvfleet.fleet.errors import APIError

KV_EVENT_SOURCES_PATH = "/kv_event_sources"
MAX_PROMPTS = 64  # as /v1/completions


def install_vllm_compat_routes(app: FastAPI, state) -> None:  # noqa: ANN001 - api_server.ServerState (no cycle)
    @app.get(KV_EVENT_SOURCES_PATH)
    async def kv_event_sources(request: Request) -> dict:
        publisher = state.vllm_kv_events.publisher
        if publisher is None or not publisher.endpoint:
            return {}  # as a vLLM pod with KV events off: no sources
        return publisher.sources(request.url.hostname or "")

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}  # smg probes it to tell a vLLM server from others

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict]:
        engine = state.require_engine()
        tokenizer = engine.tokenizer
        prompts = [body.prompt] if isinstance(body.prompt, str) or not body.prompt or isinstance(
            body.prompt[0], int) else list(body.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), engine.max_model_len, tokenizer.max_token_chars,
                                   f"prompt.{i}")
                prompt = await asyncio.to_thread(tokenizer.encode, prompt)
            out.append(_rendered(state.model_name, list(prompt)))
        return out

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict:
        engine = state.require_engine()
        tokenizer = engine.tokenizer
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            check_prompt_chars(sum(len(m["content"]) for m in messages), engine.max_model_len,
                               tokenizer.max_token_chars, "messages")
            token_ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        return _rendered(state.model_name, token_ids)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        engine = state.require_engine()
        requested_adapter(state.model_name, state.require_engine().lora_registry, body.model)
        tokenizer, max_model_len = engine.tokenizer, engine.max_model_len
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt (text) or messages (a chat), not both or neither", param="prompt")
        try:
            if body.messages is not None:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                check_prompt_chars(sum(len(m["content"]) for m in messages), max_model_len,
                                   tokenizer.max_token_chars, "messages")
                tokens = await asyncio.to_thread(tokenizer.apply_chat_template, messages, body.add_generation_prompt,
                                                 body.continue_final_message)
            else:
                check_prompt_chars(len(body.prompt), max_model_len, tokenizer.max_token_chars, "prompt")
                tokens = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt" if body.messages is None else "messages") from err
        strs = tokenizer.token_strs(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        engine = state.require_engine()
        requested_adapter(state.model_name, state.require_engine().lora_registry, body.model)
        vocab, limit = engine.vocab_size, engine.max_model_len * MAX_PROMPTS
        if len(body.tokens) > limit:
            raise APIError(400, f"tokens: at most {limit} token ids per request, got {len(body.tokens)}",
                           param="tokens")
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens.{bad} must be a token id in [0, {vocab}), got {body.tokens[bad]}",
                           param=f"tokens.{bad}")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}


def _rendered(model: str, token_ids: list[int]) -> dict:
    """vLLM's GenerateRequest as its render routes answer it (routers read token_ids)."""
    return {"request_id": f"render-{uuid.uuid4().hex}", "model": model, "token_ids": token_ids,
            "sampling_params": {}}
