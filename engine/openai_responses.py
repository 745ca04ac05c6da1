"""OpenAI response bodies and SSE events built from the engine's outputs (completions and chat completions)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from kvfleet.engine.api_errors import APIError
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampler import TokenLogprobs
from kvfleet.engine.tokenizer import Tokenizer


@dataclass
class Reply:
    """Who is answering what: the parts every body and chunk of one response share."""

    request_id: str
    model: str
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def usage(out: RequestOutput) -> dict:
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": out.num_output_tokens,
            "total_tokens": prompt + out.num_output_tokens}


def completion_logprobs(reply: Reply, token_ids: list[int], logprobs: list[TokenLogprobs],
                        text_offset: int = 0) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    if not logprobs:
        return None
    tokens = [reply.token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.token_logprob for lp in logprobs],
            "top_logprobs": [{reply.token_text(t): p for t, p in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(reply: Reply, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict | None:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    if not logprobs:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = reply.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp.token_logprob), "top_logprobs": [entry(i, p) for i, p in lp.top]}
                        for t, lp in zip(token_ids, logprobs, strict=True)]}


async def _collect(stream: AsyncIterator[RequestOutput]) -> tuple[RequestOutput, str, list[int], list]:
    text, token_ids, logprobs, out = "", [], [], None
    async for out in stream:
        text += out.text_delta
        token_ids += out.new_token_ids
        logprobs += out.logprobs
    if out.finish_reason == "error":
        raise APIError(500, f"the engine failed this request: {out.error}", "server_error")
    return out, text, token_ids, logprobs


async def completion_body(reply: Reply, stream: AsyncIterator[RequestOutput]) -> dict:
    out, text, token_ids, logprobs = await _collect(stream)
    return {"id": reply.request_id, "object": "text_completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "text": text, "logprobs": completion_logprobs(reply, token_ids, logprobs),
                         "finish_reason": out.finish_reason}],
            "usage": usage(out)}


async def chat_body(reply: Reply, stream: AsyncIterator[RequestOutput]) -> dict:
    out, text, token_ids, logprobs = await _collect(stream)
    return {"id": reply.request_id, "object": "chat.completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": chat_logprobs(reply, token_ids, logprobs), "finish_reason": out.finish_reason}],
            "usage": usage(out)}


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _engine_failure(out: RequestOutput) -> dict:
    return APIError(500, f"the engine failed this request: {out.error}", "server_error").body()


async def completion_events(reply: Reply, stream: AsyncIterator[RequestOutput],
                            include_usage: bool) -> AsyncIterator[dict]:
    last, offset = None, 0
    async for out in stream:
        last = out
        if out.finish_reason == "error":
            yield _engine_failure(out)
            return
        if out.text_delta or out.finished or out.logprobs:
            logprobs = completion_logprobs(reply, out.new_token_ids, out.logprobs, offset)
            offset += len(out.text_delta)
            yield {"id": reply.request_id, "object": "text_completion", "created": reply.created,
                   "model": reply.model, "choices": [{"index": 0, "text": out.text_delta, "logprobs": logprobs,
                                                      "finish_reason": out.finish_reason if out.finished else None}]}
    if last is not None and include_usage:
        yield {"id": reply.request_id, "object": "text_completion", "created": reply.created, "model": reply.model,
               "choices": [], "usage": usage(last)}


async def chat_events(reply: Reply, stream: AsyncIterator[RequestOutput], include_usage: bool) -> AsyncIterator[dict]:
    def chunk(delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"id": reply.request_id, "object": "chat.completion.chunk", "created": reply.created,
                "model": reply.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    yield chunk({"role": "assistant", "content": ""}, None)
    last = None
    async for out in stream:
        last = out
        if out.finish_reason == "error":
            yield _engine_failure(out)
            return
        if out.text_delta or out.logprobs:
            yield chunk({"content": out.text_delta}, None, chat_logprobs(reply, out.new_token_ids, out.logprobs))
        if out.finished:
            yield chunk({}, out.finish_reason)
    if last is not None and include_usage:
        yield {"id": reply.request_id, "object": "chat.completion.chunk", "created": reply.created,
               "model": reply.model, "choices": [], "usage": usage(last)}
