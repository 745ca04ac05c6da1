"""The shared-prefix benchmark's client side: send a planned chat workload open-loop (streamed, one record per
request) or hold its conversations closed-loop, and read the engines' own prefix-cache and request counters before
and after."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.prefix_workload import PlannedChat, PlannedConversation
from kvfleet.fleet import metrics as names
from kvfleet.fleet.headers import ENGINE as ENGINE_HEADER
from kvfleet.loadgen import SSE_DONE, RequestRecord, sse_data

# Each counter under kvfleet's engine's name and vLLM's (whichever the engine serves; vLLM's carry labels).
COUNTERS = {"hits": (f"{names.PREFIX_CACHE_HITS}_total", f"{names.VLLM_PREFIX_CACHE_HITS}_total"),
            "queries": (f"{names.PREFIX_CACHE_QUERIES}_total", f"{names.VLLM_PREFIX_CACHE_QUERIES}_total"),
            "requests": (f"{names.E2E_REQUEST_LATENCY}_count", f"{names.VLLM_E2E_REQUEST_LATENCY}_count"),
            "prompt_tokens": (f"{names.PROMPT_TOKENS}_total", f"{names.VLLM_PROMPT_TOKENS}_total"),
            # the engine's own time to first token (from the request's arrival there): the rest is the router's
            "engine_ttft_sum": (f"{names.TIME_TO_FIRST_TOKEN}_sum", f"{names.VLLM_TIME_TO_FIRST_TOKEN}_sum"),
            "engine_ttft_count": (f"{names.TIME_TO_FIRST_TOKEN}_count", f"{names.VLLM_TIME_TO_FIRST_TOKEN}_count")}
MAX_LINE = 1 << 20  # an answer's SSE line longer than this is not a chunk of 16 tokens


async def read_counters(client: httpx.AsyncClient, engine_urls: list[str]) -> dict[str, dict[str, float]]:
    """Per engine URL, the COUNTERS from its /metrics (missing ones as 0)."""
    async def one(url: str) -> dict[str, float]:
        text = (await client.get(url + "/metrics", timeout=10)).text
        found = dict.fromkeys(COUNTERS, 0.0)
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            name = name.partition("{")[0]
            for key, wanted in COUNTERS.items():
                if name in wanted:
                    found[key] += float(value)
        return found

    return dict(zip(engine_urls, await asyncio.gather(*(one(u) for u in engine_urls)), strict=True))


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per engine, what each counter gained between two readings."""
    return {url: {k: after[url][k] - before[url].get(k, 0.0) for k in COUNTERS} for url in after}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord, started: float,
                      text: list[str] | None = None) -> None:
    """POST one streamed chat and fill `record`: TTFT at the first content chunk, output tokens, errors; the
    answer's content into `text` when given."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        record.status = response.status_code
        record.engine = response.headers.get(ENGINE_HEADER)
        if response.status_code != 200:
            record.error = (await response.aread())[:500].decode(errors="replace")
            return
        chunks, done = 0, False
        async for line in response.aiter_lines():
            if len(line) > MAX_LINE:
                raise ValueError(f"an SSE line of {len(line)} characters")
            data = sse_data(line)
            if data is None:
                continue
            if data == SSE_DONE:
                done = True
                break
            event = json.loads(data)
            if event.get("error"):
                record.error = str(event["error"])[:500]
            choices = event.get("choices") or [{}]
            if content := (choices[0].get("delta") or {}).get("content"):
                chunks += 1
                if text is not None:
                    text.append(content)
                if record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - started
            if event.get("usage"):
                chunks = event["usage"].get("completion_tokens") or chunks
        record.output_tokens = chunks
        if not done and record.error is None:
            record.error = "the stream ended before data: [DONE]"


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: PlannedChat, max_tokens: int,
                   timeout: float, run_start: float, text: list[str] | None = None) -> RequestRecord:
    started = time.perf_counter()
    record = RequestRecord(req.index, "standard", started - run_start)
    body = {"model": model, "messages": req.messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with asyncio.timeout(timeout):
            await stream_chat(client, url, body, record, started, text)
    except TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.e2e_s = time.perf_counter() - started
    return record


async def run_plan(url: str | list[str], model: str, plan: list[PlannedChat], engine_urls: list[str], warmup: int,
                   max_tokens: int, timeout: float) -> tuple[list[RequestRecord], dict[str, dict]]:
    """Send `plan` at its arrival times through `url` (several: gateway replicas, dealt in turn); the records, and
    the engines' counter deltas from the sending of request `warmup` (the first one measured) until every request
    has finished."""
    urls = [url] if isinstance(url, str) else url
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        before = await read_counters(client, engine_urls)
        run_start = time.perf_counter()
        tasks = []
        for req in plan:
            delay = run_start + req.send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if req.index == warmup:
                before = await read_counters(client, engine_urls)
            tasks.append(asyncio.create_task(send_one(client, urls[req.index % len(urls)], model, req, max_tokens,
                                                      timeout, run_start)))
        records = await asyncio.gather(*tasks)
        after = await read_counters(client, engine_urls)
    return sorted(records, key=lambda r: r.index), counter_deltas(before, after)


async def run_conversations(url: str | list[str], model: str, conversations: list[PlannedConversation],
                            engine_urls: list[str], max_tokens: int,
                            timeout: float) -> tuple[list[RequestRecord], dict[str, dict], list[PlannedChat]]:
    """Hold each conversation from its start: a turn is sent `think_s` after the previous answer ended, with the whole
    conversation so far (the model's own answers included). The records, the engines' counter deltas over the run,
    and each turn as sent (index = record index; first_of_key = a conversation's first turn)."""
    urls = [url] if isinstance(url, str) else url
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sent: list[PlannedChat] = []
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        before = await read_counters(client, engine_urls)
        run_start = time.perf_counter()

        async def converse(conversation: PlannedConversation) -> None:
            await asyncio.sleep(max(0.0, run_start + conversation.start_at - time.perf_counter()))
            history = [{"role": "system", "content": conversation.system}]
            for turn, (question, think_s) in enumerate(zip(conversation.questions, conversation.think_s, strict=True)):
                history = [*history, {"role": "user", "content": question}]
                turn_sent = PlannedChat(len(sent), time.perf_counter() - run_start, history, conversation.key,
                                        turn == 0)
                sent.append(turn_sent)
                answer: list[str] = []
                record = await send_one(client, urls[turn_sent.index % len(urls)], model, turn_sent, max_tokens,
                                        timeout, run_start, answer)
                records.append(record)
                if not record.ok:
                    return  # a user whose turn failed does not go on with that conversation
                history = [*history, {"role": "assistant", "content": "".join(answer)}]
                await asyncio.sleep(think_s)

        await asyncio.gather(*(converse(c) for c in conversations))
        after = await read_counters(client, engine_urls)
    return sorted(records, key=lambda r: r.index), counter_deltas(before, after), sent


async def closed_loop(engine_urls: list[str], model: str, plan: list[PlannedChat], per_engine: int,
                      seconds: float, warmup_s: float, max_tokens: int) -> dict:
    """Capacity: each engine kept `per_engine` requests full, straight (no router), for warmup_s + seconds;
    completions per second after the warm-up."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    requests = iter(plan)
    done: dict[str, int] = dict.fromkeys(engine_urls, 0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        run_start = time.perf_counter()
        until = run_start + warmup_s + seconds

        async def worker(url: str) -> None:
            while time.perf_counter() < until:
                record = await send_one(client, url, model, next(requests), max_tokens, 300.0, run_start)
                if not record.ok:
                    raise RuntimeError(f"calibration request to {url} failed: {record.status} {record.error}")
                if warmup_s <= record.sent_at + record.e2e_s <= warmup_s + seconds:
                    done[url] += 1

        await asyncio.gather(*(worker(u) for u in engine_urls for _ in range(per_engine)))
    by_engine = {url: n / seconds for url, n in done.items()}
    return {"requests_per_s": sum(by_engine.values()), "by_engine": by_engine, "seconds": seconds}
