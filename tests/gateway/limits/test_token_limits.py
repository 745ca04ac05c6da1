"""Tokens-per-minute limits that hold: reserved at admission, settled with the engine's count, atomic in Redis.

Real parts: a real Redis (the fixtures), a real gateway process and a real tiny-model engine for the end-to-end tests,
the official `openai` client. Inputs tried: a concurrent burst on a small tpm, streams with and without
`include_usage`, `n > 1`, a request the engine refuses, hostile max_tokens/n types.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from kvfleet.gateway.limits.keys import KeyInfo, hash_key
from kvfleet.gateway.limits.rate_limit import InProcessRateLimiter, RateLimiter
from kvfleet.gateway.limits.usage import (
    Settlement,
    StreamUsageMeter,
    Usage,
    answer_usage,
    ask_stream_usage,
)
from kvfleet.gateway.token_estimate import Cost, request_cost
from tests.conftest import start_gateway, stop_process
from tests.support.gateways import wait_until_routable
from tests.support.token_windows import FLEET, settled_window, usage_chunk_only_to_who_asked, window_tokens

T0 = 1_700_000_000.25
BURST_KEY = "sk-burst-" + "b" * 20  # tpm=500
COUNTED_KEY = "sk-counted-" + "c" * 20  # a large tpm: only the accounting is looked at


# ---- what an answer used (pure) --------------------------------------------------------------------------------
def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


CONTENT = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b", "c")]
USAGE_CHUNK = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def relay(meter: StreamUsageMeter, stream: bytes, piece: int) -> bytes:
    out = [meter.feed(stream[i:i + piece]) for i in range(0, len(stream), piece)]
    return b"".join(out) + meter.finish()


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_the_usage_chunk_only_the_gateway_asked_for_is_counted_and_hidden(piece: int) -> None:
    upstream = sse(*CONTENT, USAGE_CHUNK, "[DONE]")
    hidden = StreamUsageMeter(hide_usage=True)
    assert relay(hidden, upstream, piece) == sse(*CONTENT, "[DONE]")  # byte for byte what the client would get
    assert hidden.usage == Usage(5, 3)
    shown = StreamUsageMeter(hide_usage=False)
    assert relay(shown, upstream, piece) == upstream and shown.usage.total == 5


def test_the_gateway_asks_for_stream_usage_only_where_the_client_did_not() -> None:
    body = {"stream": True}
    assert ask_stream_usage(body) and body["stream_options"] == {"include_usage": True}
    assert not ask_stream_usage({"stream": True, "stream_options": {"include_usage": True}})
    assert not ask_stream_usage({"stream": False}) and not ask_stream_usage({"stream": "yes"})
    assert not ask_stream_usage({"stream": True, "stream_options": "bad"})  # left for the schema's 400
    assert not ask_stream_usage({"stream": True, "stream_options": {"include_usage": 0}})


def test_a_settlement_counts_once_and_falls_back_when_the_answer_has_no_count() -> None:
    settled: list[int] = []
    cost = Cost(prompt=10, completion=100)
    first = Settlement(cost, settled.append)
    first(Usage(42))
    first.refund()  # after an answer: no second settlement
    Settlement(cost, settled.append)(Usage(None, streamed_events=7))  # a stream cut short
    Settlement(cost, settled.append)(answer_usage(200, b'{"choices": []}'))  # a success without usage
    Settlement(cost, settled.append)(answer_usage(400, b'{"error": {}}'))  # refused: nothing generated
    assert settled == [42, 17, 110, 0]
    assert answer_usage(200, b'{"usage": {"total_tokens": 9}}') == Usage(9)


# ---- the limiter: atomic reservations in Redis, the same policy in-process ------------------------------------
async def burst(limiters: list, key: KeyInfo, count: int, tokens: int) -> list:
    return await asyncio.gather(*(limiters[i % len(limiters)].admit(key, tokens, now=T0) for i in range(count)))


def test_a_concurrent_burst_on_two_replicas_overshoots_by_at_most_one_reservation(redis_server) -> None:
    key = KeyInfo(hash_key(BURST_KEY)[:12], "burst", tpm=500)

    async def run() -> None:
        async with Redis.from_url(redis_server.url) as a, Redis.from_url(redis_server.url) as b:
            replicas = [RateLimiter(a, FLEET), RateLimiter(b, FLEET)]
            verdicts = await burst(replicas, key, 20, 52)
            admitted = [v for v in verdicts if v.allowed]
            assert 500 <= 52 * len(admitted) <= 500 + 52 and len(admitted) == 10
            assert {v.reason for v in verdicts if not v.allowed} == {"tpm"}
            with SyncRedis.from_url(redis_server.url) as sync:
                assert window_tokens(sync, BURST_KEY, T0) == 52 * len(admitted)
                for v in admitted:  # the real counts: a few refunded tokens each
                    await replicas[0].settle(v.reservation, 40, now=T0 + 1)
                assert window_tokens(sync, BURST_KEY, T0) == 40 * len(admitted)
                assert (await replicas[1].admit(key, 52, now=T0 + 2)).allowed  # 400 < 500: room again
                late = (await replicas[1].admit(key, 52, now=T0 + 2)).reservation
                await replicas[0].settle(late, 200, now=T0 + 70)  # settled after its bucket left the window
                assert window_tokens(sync, BURST_KEY, T0 + 70) == 200 - 52  # only the shortfall is still owed

    asyncio.run(run())


def test_the_in_process_fallback_applies_the_same_reservations() -> None:
    key = KeyInfo("k1", "local", tpm=500)

    async def run() -> None:
        limiter = InProcessRateLimiter()
        verdicts = await burst([limiter], key, 20, 52)
        admitted = [v for v in verdicts if v.allowed]
        assert len(admitted) == 10 and all(v.reservation.local for v in admitted)
        for v in admitted:
            await limiter.settle(v.reservation, 0, now=T0 + 1)  # every one refunded: the window is empty
        assert len([v for v in await burst([limiter], key, 20, 52) if v.allowed]) == 10

    asyncio.run(run())


# ---- end to end: a real gateway, a real engine, a real Redis ----------------------------------------------------
@pytest.fixture(scope="module")
def gateway(tiny_server: str, redis_server_module, tmp_path_factory) -> str:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{BURST_KEY} name=burst tpm=500\n{COUNTED_KEY} name=counted tpm=100000000\n")
    proc, url = start_gateway("--engine", tiny_server, "--redis-url", redis_server_module.url, "--fleet", FLEET,
                              "--api-keys-file", str(keys))
    wait_until_routable(url)
    yield url
    stop_process(proc)


@pytest.fixture(scope="module")
def model(tiny_server: str) -> str:
    return httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]


@pytest.fixture
def redis(redis_server_module):
    with SyncRedis.from_url(redis_server_module.url) as client:
        yield client


def test_a_burst_of_20_requests_admits_at_most_tpm_plus_one_reservation(gateway: str, model: str, redis) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=BURST_KEY, max_retries=0)
    prompt, max_tokens = "Hello", 50
    reservation = request_cost({"prompt": prompt, "max_tokens": max_tokens}).tokens

    async def one():
        try:
            return await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
        except openai.RateLimitError as err:
            return err

    async def run() -> None:
        answers = await asyncio.gather(*(one() for _ in range(20)))
        served = [a.usage.total_tokens for a in answers if not isinstance(a, Exception)]
        refused = [a for a in answers if isinstance(a, Exception)]
        assert served and refused
        assert sum(served) <= 500 + reservation
        error = refused[0].response
        assert error.status_code == 429 and error.json()["error"]["code"] == "tpm_limit"
        assert 1 <= int(error.headers["retry-after"]) <= 60
        assert await settled_window(redis, BURST_KEY, sum(served)) == sum(served)  # exactly what was generated

    asyncio.run(run())


def test_streams_and_every_choice_count_their_real_tokens(gateway: str, model: str, redis) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=COUNTED_KEY, max_retries=0)

    async def run() -> None:
        before = await usage_chunk_only_to_who_asked(client, model, redis, COUNTED_KEY)

        three = await client.completions.create(model=model, prompt="Once upon", max_tokens=6, n=3,
                                                extra_body={"ignore_eos": True})
        assert len(three.choices) == 3 and three.usage.completion_tokens == 18
        before = await settled_window(redis, COUNTED_KEY, before + three.usage.total_tokens)

        with pytest.raises(openai.BadRequestError):  # the engine refuses it: the reservation is refunded
            await client.completions.create(model=model, prompt="hi", max_tokens=100_000)
        assert await settled_window(redis, COUNTED_KEY, before) == before

    asyncio.run(run())
