"""The tokens-per-minute windows the gateway keeps in Redis, read as a test checks them."""

from __future__ import annotations

import asyncio
import time

import openai
from redis import Redis as SyncRedis

from kvfleet.fleet.redis_keys import key_prefix
from kvfleet.gateway.limits.keys import hash_key
from kvfleet.gateway.limits.rate_limit import WINDOW_S

FLEET = "tokens"


def window_tokens(redis: SyncRedis, key: str, now: float | None = None) -> int:
    """The tokens the key's Redis window holds at `now` (default: the wall clock)."""
    fields = redis.hgetall(f"{key_prefix(FLEET)}ratelimit:{hash_key(key)[:12]}")
    oldest = int(time.time() if now is None else now) - WINDOW_S
    return sum(int(v) for f, v in fields.items() if f.startswith(b"t:") and int(f[2:]) > oldest)


async def settled_window(redis: SyncRedis, key: str, expected: int) -> int:
    """The key's token window once the gateway has settled (it writes just after the answer)."""
    for _ in range(50):
        if (total := window_tokens(redis, key)) == expected:
            return total
        await asyncio.sleep(0.05)
    return window_tokens(redis, key)


async def usage_chunk_only_to_who_asked(client: openai.AsyncOpenAI, model: str, redis, key: str) -> int:
    """A stream that asked for usage gets the usage chunk, one that did not gets the same chunks without it (the
    gateway asks the engine itself and hides it again); both settle at their real count. The window after."""
    chat = dict(model=model, messages=[{"role": "user", "content": "Count to five"}], max_tokens=12,
                temperature=0)

    async def streamed(**extra) -> list:
        return [chunk async for chunk in await client.chat.completions.create(stream=True, **chat, **extra)]

    before = window_tokens(redis, key)
    asked = await streamed(stream_options={"include_usage": True})
    usage = asked[-1].usage
    assert asked[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    before = await settled_window(redis, key, before + usage.total_tokens)

    plain = await streamed()
    assert all(chunk.choices and chunk.usage is None for chunk in plain)
    assert [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in plain] == \
        [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in asked[:-1]]
    after = await settled_window(redis, key, before + usage.total_tokens)
    assert after == before + usage.total_tokens
    return after
