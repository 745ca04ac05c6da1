"""The engine's OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health and readiness.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for invalid input or a request that
failed alone in the engine, 401 without the engine token (when one is set), 404 for an unknown model or route, 413
for a body over the limit, 429 with Retry-After when the waiting queue is full, 503 while loading or draining, 500
with `x-kvfleet-fault: engine` when the engine itself failed (docs/api.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kvfleet.engine.async_engine import AsyncEngine, EngineDeadError
from kvfleet.engine.kv_event_hub import KVEventHub
from kvfleet.engine.llm_engine import EngineAsleepError, RequestError
from kvfleet.engine.lora_registry import LoraSpec
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import QueueFullError
from kvfleet.engine.server.api_key import EngineAPIKey
from kvfleet.engine.server.kv_events_api import install_kv_event_routes
from kvfleet.engine.server.kv_events_zmq import VllmKVEvents
from kvfleet.engine.server.lora_api import adapter_cards, install_lora_routes, requested_adapter
from kvfleet.engine.server.openai_responses import (
    Reply,
    chat_body,
    chat_events,
    completion_body,
    completion_events,
    sse,
)
from kvfleet.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestSchemaError,
    SamplingRequest,
    check_against_model,
    sampling_params,
)
from kvfleet.engine.server.request_checks import StrictJSONRoute, check_prompt_chars
from kvfleet.engine.server.sglang_compat_api import install_sglang_compat_routes
from kvfleet.engine.server.sleep_api import install_sleep_routes
from kvfleet.engine.server.vllm_compat_api import install_vllm_compat_routes
from kvfleet.fleet.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from kvfleet.fleet.errors import APIError, engine_fault, install_error_handlers
from kvfleet.fleet.headers import RETRY_AFTER
from kvfleet.fleet.http_limits import BodyDeadline, HttpLimits
from kvfleet.fleet.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS, describe_unknown_fields

MAX_PROMPTS = 64  # prompts in one batched completions request
DISCONNECT_POLL_SECONDS = 0.25

log = logging.getLogger("kvfleet.engine")


@dataclass
class ServerState:
    """What the routes need; engine is None until the model is loaded and warmed up."""

    model_name: str
    engine: AsyncEngine | None = None
    metrics: EngineMetrics = field(init=False)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    kv_events: KVEventHub = field(default_factory=KVEventHub)  # the engine publishes into it once loaded
    kv_events_sse: bool = True  # GET /kv_events serves the hub (off: only vLLM's ZMQ format, if on)
    vllm_kv_events: VllmKVEvents = field(default_factory=VllmKVEvents)  # vLLM's discovery and ZMQ publisher

    def __post_init__(self) -> None:
        self.metrics = EngineMetrics(lambda: self.engine.stats() if self.engine is not None else None)

    def require_engine(self) -> AsyncEngine:
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the engine is shutting down; retry on another replica", "service_unavailable",
                           headers={RETRY_AFTER: "1"})
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", "service_unavailable",
                           headers={RETRY_AFTER: "2"})
        return self.engine


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: _ErrorDetail


_ERROR = {"model": ErrorBody, "content": {"application/json": {}}}
GENERATION_RESPONSES: dict = {
    200: {"content": {"application/json": {}, "text/event-stream": {}},
          "description": "a response body, or server-sent events when stream is true"},
    400: {**_ERROR, "description": "invalid request"}, 404: {**_ERROR, "description": "unknown model"},
    413: {**_ERROR, "description": "body too large"}, 429: {**_ERROR, "description": "waiting queue full"},
    499: {"description": "the client went away before the answer"},
    401: {**_ERROR, "description": "engine token missing or wrong (only when --api-key is set)"},
    500: {**_ERROR, "description": "the engine failed (header x-kvfleet-fault: engine)"},
    503: {**_ERROR, "description": "loading or draining"},
}


def build_app(state: ServerState, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None
              ) -> FastAPI:
    app = FastAPI(title="kvfleet engine", version="0.1.0")
    app.router.route_class = StrictJSONRoute  # generation bodies pass the strict schema before anything else
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BodyDeadline, seconds=HttpLimits().body_timeout_s)  # a body sent byte by byte: 408
    if api_key:
        app.add_middleware(EngineAPIKey, api_key=api_key)  # added last: runs first, before the body is read
    install_error_handlers(app)
    install_engine_fault_handlers(app)

    @app.get("/health", responses={503: {"description": "loading"}})
    async def health() -> JSONResponse:
        # As vLLM's: 200 once the model can serve (routers in front register a worker the moment it answers);
        # Kubernetes' startup probe waits on it meanwhile, and draining stays alive until it ends.
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready", responses={503: {"description": "loading or draining"}})
    async def ready() -> JSONResponse:
        if state.engine is None or state.draining or state.engine.sleeping or state.engine.sleep_pending:
            reason = "draining" if state.draining else "loading" if state.engine is None else "sleeping"
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics(request: Request) -> Response:
        names = request.query_params.getlist("name[]")
        return Response(state.metrics.render(names), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        registry = state.engine.lora_registry if state.engine is not None else None
        return {"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvfleet"},
            *adapter_cards(state.model_name, registry, state.created),
        ]}

    if state.kv_events_sse:
        install_kv_event_routes(app, state)
    install_vllm_compat_routes(app, state)
    install_sglang_compat_routes(app, state)
    install_lora_routes(app, state)
    install_sleep_routes(app, state)
    app.router.add_event_handler("startup", state.vllm_kv_events.start)
    app.router.add_event_handler("shutdown", state.vllm_kv_events.stop)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        engine = state.require_engine()
        lora = _check_model(state, engine, body)
        prompts = _prompt_list(body.prompt)
        _check_request(engine, body, len(prompts))
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), engine.max_model_len, engine.tokenizer.max_token_chars,
                                   "prompt" if len(prompts) == 1 else f"prompt.{i}")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = _params(body, max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs asks for the prompt's logprobs, which this engine does not "
                           "compute; send one of them", param="echo")
        echo = await asyncio.to_thread(_echo_texts, engine, prompts, body.skip_special_tokens) if body.echo else []
        streams, prompt_ids = await _start_choices(state, engine, prompts, params, body.n, request_id, body.priority,
                                                   lora)
        reply = Reply(request_id, _answering(state, lora), engine.tokenizer, body.n, echo=echo,
                      prompt_token_ids=prompt_ids if body.return_token_ids else None)
        if body.stream:
            return sse(completion_events(reply, streams, _include_usage(body)))
        return await _unless_disconnected(request, completion_body(reply, streams))

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = state.require_engine()
        lora = _check_model(state, engine, body)
        _check_request(engine, body, 1)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            check_prompt_chars(sum(len(m["content"]) for m in messages), engine.max_model_len,
                               engine.tokenizer.max_token_chars, "messages")
            prompt = await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages, True,
                                             body.continue_final_message)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        max_tokens = body.effective_max_tokens()
        if max_tokens is None:  # as vLLM: whatever room the context leaves
            max_tokens = max(1, engine.max_model_len - len(prompt))
        params = _params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams, prompt_ids = await _start_choices(state, engine, [prompt], params, body.n, request_id,
                                                   body.priority, lora)
        last = messages[-1]
        echo = [last["content"]] if body.echo and last["role"] == "assistant" else []
        reply = Reply(request_id, _answering(state, lora), engine.tokenizer, body.n, echo=echo,
                      prompt_token_ids=prompt_ids if body.return_token_ids else None)
        if body.stream:
            return sse(chat_events(reply, streams, _include_usage(body)))
        return await _unless_disconnected(request, chat_body(reply, streams))

    return app


# --- request handling ---------------------------------------------------------------------------


async def _unless_disconnected(request: Request, work) -> dict | Response:
    """Await a non-streaming response, but abort the request (freeing its KV) if the client goes away."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


def _include_usage(body: SamplingRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# Unknown-field sets already logged: routers in front (sglang-router, vllm-router) add the same extra fields to
# every request, and a warning per request costs the engine CPU on the hot path; the metric counts every one.
_LOGGED_UNKNOWN: set[str] = set()
_MAX_LOGGED_UNKNOWN = 256  # beyond this many distinct sets (a client making names up), only the metric counts


def _answering(state: ServerState, lora: LoraSpec | None) -> str:
    """The `model` an answer names: the adapter's name for an adapter's request, as vLLM answers."""
    return state.model_name if lora is None else lora.name


def _check_model(state: ServerState, engine: AsyncEngine, body: SamplingRequest) -> LoraSpec | None:
    """The adapter the body's model names (None: the base model); logs unknown fields once per set."""
    ignored = body.unknown_fields()
    if ignored:  # newer clients send fields we do not know yet: serve them, and say so (escaped, bounded)
        state.metrics.ignored_fields.inc(len(ignored))
        described = describe_unknown_fields(ignored)
        if described not in _LOGGED_UNKNOWN and len(_LOGGED_UNKNOWN) < _MAX_LOGGED_UNKNOWN:
            _LOGGED_UNKNOWN.add(described)
            log.warning("ignored unknown request fields (logged once per set of names): %s", described)
    return requested_adapter(state.model_name, engine.lora_registry, body.model)


def _check_request(engine: AsyncEngine, body: SamplingRequest, num_prompts: int) -> None:
    try:
        check_against_model(body, engine.vocab_size, num_prompts)
    except RequestSchemaError as err:
        raise APIError(400, err.message, param=err.param) from None


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """One or more prompts: a string, token ids, or a list of either (OpenAI's batched prompts)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    return list(prompt)


def _echo_texts(engine: AsyncEngine, prompts: list[str | list[int]], skip_special_tokens: bool) -> list[str]:
    """The prompts as echo repeats them: text as sent, token ids decoded. Ids outside the vocabulary and prompts longer
    than the context are left to the engine, which refuses them with a 400 before anything runs: none is decoded."""
    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    longest = engine.max_model_len
    return [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=skip_special_tokens)
            if len(p) <= longest and all(0 <= t < vocab for t in p) else "" for p in prompts]


def _params(body: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return sampling_params(body, max_tokens, logprobs)
    except RequestSchemaError as err:
        raise APIError(400, err.message, param=err.param) from None


async def _start_choices(state: ServerState, engine: AsyncEngine, prompts: list[str | list[int]],
                         params: SamplingParams, n: int, request_id: str, priority: int, lora: LoraSpec | None
                         ) -> tuple[list[AsyncIterator[RequestOutput]], list[list[int]]]:
    """One engine request per choice (n per prompt), and each prompt's token ids; if one is refused, the ones
    already started are aborted."""
    streams: list[AsyncIterator[RequestOutput]] = []
    prompt_ids: list[list[int]] = []
    try:
        for p_index, prompt in enumerate(prompts):
            for copy in range(n):
                choice_params = params
                if params.seed is not None and copy:  # seeded copies differ from each other, reproducibly
                    # a 64-bit seed space wraps around, so seed 2**64 - 1 with n > 1 stays valid
                    choice_params = dataclasses.replace(params, seed=(params.seed + copy) % 2**64)
                index = p_index * n + copy
                choice_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
                stream, ids = await _start(state, engine, prompt, choice_params, choice_id, priority, lora)
                streams.append(stream)
                if copy == 0:
                    prompt_ids.append(ids)
    except APIError:
        for stream in streams:
            await stream.aclose()
        raise
    return streams, prompt_ids


async def _start(state: ServerState, engine: AsyncEngine, prompt: str | list[int], params: SamplingParams,
                 request_id: str, priority: int, lora: LoraSpec | None
                 ) -> tuple[AsyncIterator[RequestOutput], list[int]]:
    """Submit and wait for the first output, so that refusals become HTTP errors before any byte is sent; the
    request's outputs, and its prompt's token ids."""
    stream = engine.generate(prompt, params, request_id, priority, lora)
    try:
        first = await stream.__anext__()
    except RequestError as err:
        state.metrics.rejected.labels("invalid").inc()
        raise APIError(400, str(err), param="prompt") from err
    except QueueFullError as err:
        state.metrics.rejected.labels("queue_full").inc()
        raise APIError(429, str(err), "rate_limit_exceeded", headers={RETRY_AFTER: "1"}) from err
    except EngineDeadError as err:
        raise engine_fault(str(err)) from err
    except EngineAsleepError as err:
        state.metrics.rejected.labels("asleep").inc()
        raise APIError(503, str(err), "service_unavailable", code="engine_asleep", headers={RETRY_AFTER: "1"}) from err

    async def chained() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    return chained(), list(first.prompt_token_ids)


# --- errors -------------------------------------------------------------------------------------


def install_engine_fault_handlers(app: FastAPI) -> None:
    """The engine's own failures answer 500 with x-kvfleet-fault: engine, so a gateway may retry elsewhere."""

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, err: EngineDeadError) -> Response:
        return engine_fault(str(err)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> Response:
        log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=err)
        return engine_fault("the engine failed unexpectedly; retry, and report it if it persists").response()
