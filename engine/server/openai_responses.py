"""OpenAI response bodies and SSE events built from the engine's outputs (completions and chat completions)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampler import TokenLogprobs
from kvfleet.engine.tokenizer import Tokenizer
from kvfleet.fleet.errors import APIError, engine_fault

log = logging.getLogger("kvfleet.engine")


@dataclass
class Reply:
    """Who is answering what: the parts every body and chunk of one response share."""

    request_id: str
    model: str
    tokenizer: Tokenizer
    n: int = 1  # choices per prompt: choice i answers prompt i // n
    created: int = field(default_factory=lambda: int(time.time()))
    echo: list[str] = field(default_factory=list)  # per prompt, the text each of its choices starts with
    prompt_token_ids: list[list[int]] | None = None  # per prompt, when the request asked for return_token_ids

    def echoed(self, choice: int) -> str:
        return self.echo[choice // self.n] if self.echo else ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_ids(self, choice: int) -> list[int]:
        return self.prompt_token_ids[choice // self.n]


def usage(reply: Reply, finals: list[RequestOutput]) -> dict:
    """Each prompt counted once however many choices it has, every choice's completion tokens."""
    prompt = sum(len(out.prompt_token_ids) for i, out in enumerate(finals) if i % reply.n == 0)
    completion = sum(out.num_output_tokens for out in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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
    if out is None or out.finish_reason == "error":
        raise request_failure(out)
    return out, text, token_ids, logprobs


async def _collect_all(streams: list[AsyncIterator[RequestOutput]]) -> list:
    """Every choice's result; when one fails (or the caller is cancelled), the others are aborted, not left running."""
    tasks = [asyncio.ensure_future(_collect(stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def completion_body(reply: Reply, streams: list[AsyncIterator[RequestOutput]]) -> dict:
    results = await _collect_all(streams)
    choices = [{"index": i, "text": reply.echoed(i) + text,
                "logprobs": completion_logprobs(reply, token_ids, logprobs),
                "finish_reason": out.finish_reason} for i, (out, text, token_ids, logprobs) in enumerate(results)]
    if reply.prompt_token_ids is not None:  # vLLM's return_token_ids: on each choice
        for i, (choice, (_, _, token_ids, _)) in enumerate(zip(choices, results, strict=True)):
            choice.update(prompt_token_ids=reply.prompt_ids(i), token_ids=token_ids)
    return {"id": reply.request_id, "object": "text_completion", "created": reply.created, "model": reply.model,
            "choices": choices, "usage": usage(reply, [r[0] for r in results])}


async def chat_body(reply: Reply, streams: list[AsyncIterator[RequestOutput]]) -> dict:
    results = await _collect_all(streams)
    choices = [{"index": i, "message": {"role": "assistant", "content": reply.echoed(i) + text},
                "logprobs": chat_logprobs(reply, token_ids, logprobs), "finish_reason": out.finish_reason}
               for i, (out, text, token_ids, logprobs) in enumerate(results)]
    body = {"id": reply.request_id, "object": "chat.completion", "created": reply.created, "model": reply.model,
            "choices": choices, "usage": usage(reply, [r[0] for r in results])}
    if reply.prompt_token_ids is not None:  # vLLM's return_token_ids: the prompt once, each choice's own tokens
        body["prompt_token_ids"] = reply.prompt_ids(0)
        for choice, (_, _, token_ids, _) in zip(choices, results, strict=True):
            choice["token_ids"] = token_ids
    return body


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several choices as they come, tagged with their choice index; closing it aborts the rest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        ended: object = None
        try:
            async for out in stream:
                await queue.put((index, out))
        except Exception as err:  # noqa: BLE001 - handed to the reader, so the stream ends with an error
            ended = err
        finally:
            await queue.put((index, ended))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            if out is None:
                remaining -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events, then [DONE]; a stream that cannot complete ends with an error event before [DONE]."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        except APIError as err:
            yield f"data: {json.dumps(err.body())}\n\n"
        except Exception as err:  # noqa: BLE001 - the engine's own failure: say so instead of cutting the stream
            log.error("a stream failed", exc_info=err)
            yield f"data: {json.dumps(engine_fault(f'the engine failed while streaming: {err}').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def request_failure(out: RequestOutput | None) -> APIError:
    """A request that failed alone in the engine (the others in its batch went on): its own fault, a 400.

    Failing alone means its input made it fail: retrying it on another engine would fail there too.
    """
    reason = out.error if out is not None else "it ended without an output"
    return APIError(400, f"this request failed in the engine: {reason}", param=None, code="request_failed")


def _engine_failure(out: RequestOutput) -> dict:
    return request_failure(out).body()


async def completion_events(reply: Reply, streams: list[AsyncIterator[RequestOutput]],
                            include_usage: bool) -> AsyncIterator[dict]:
    finals: dict[int, RequestOutput] = {}
    offsets = [0] * len(streams)
    sent_prompt: set[int] = set()
    for index in range(len(streams)):
        if reply.echoed(index):  # as vLLM streams an echo: the prompt in a chunk of its own, first
            yield {"id": reply.request_id, "object": "text_completion", "created": reply.created,
                   "model": reply.model, "choices": [{"index": index, "text": reply.echoed(index), "logprobs": None,
                                                      "finish_reason": None}]}
    async for index, out in merged(streams):
        if out.finish_reason == "error":
            yield _engine_failure(out)
            return
        if out.finished:
            finals[index] = out
        ids = reply.prompt_token_ids is not None
        if out.text_delta or out.finished or out.logprobs or (ids and out.new_token_ids):
            logprobs = completion_logprobs(reply, out.new_token_ids, out.logprobs, offsets[index])
            offsets[index] += len(out.text_delta)
            choice = {"index": index, "text": out.text_delta, "logprobs": logprobs,
                      "finish_reason": out.finish_reason if out.finished else None}
            if ids:  # vLLM's return_token_ids: the prompt's in each choice's first chunk, then each chunk's own
                if index not in sent_prompt:
                    sent_prompt.add(index)
                    choice["prompt_token_ids"] = reply.prompt_ids(index)
                choice["token_ids"] = out.new_token_ids
            yield {"id": reply.request_id, "object": "text_completion", "created": reply.created,
                   "model": reply.model, "choices": [choice]}
    if include_usage and len(finals) == len(streams):
        yield {"id": reply.request_id, "object": "text_completion", "created": reply.created, "model": reply.model,
               "choices": [], "usage": usage(reply, [finals[i] for i in range(len(streams))])}


async def chat_events(reply: Reply, streams: list[AsyncIterator[RequestOutput]],
                      include_usage: bool) -> AsyncIterator[dict]:
    ids = reply.prompt_token_ids is not None

    def chunk(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None,
              token_ids: list[int] | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if ids and token_ids is not None:  # vLLM's return_token_ids: each chunk's own tokens
            choice["token_ids"] = token_ids
        return {"id": reply.request_id, "object": "chat.completion.chunk", "created": reply.created,
                "model": reply.model, "choices": [choice]}

    for index in range(len(streams)):
        first = chunk(index, {"role": "assistant", "content": reply.echoed(index)}, None)
        if ids and index == 0:  # the prompt's, once, in the first chunk (vLLM's place for it)
            first["prompt_token_ids"] = reply.prompt_ids(0)
        yield first
    finals: dict[int, RequestOutput] = {}
    async for index, out in merged(streams):
        if out.finish_reason == "error":
            yield _engine_failure(out)
            return
        if out.text_delta or out.logprobs or (ids and out.new_token_ids):
            yield chunk(index, {"content": out.text_delta}, None,
                        chat_logprobs(reply, out.new_token_ids, out.logprobs), out.new_token_ids)
        if out.finished:
            finals[index] = out
            yield chunk(index, {}, out.finish_reason, token_ids=[])
    if include_usage and len(finals) == len(streams):
        yield {"id": reply.request_id, "object": "chat.completion.chunk", "created": reply.created,
               "model": reply.model, "choices": [], "usage": usage(reply, [finals[i] for i in range(len(streams))])}
