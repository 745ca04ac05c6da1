"""Per-key rpm/tpm limits in a real Redis, shared by gateway replicas, and enforced locally while Redis is down."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from redis.asyncio import Redis

from kvfleet.gateway.limits import rate_limit
from kvfleet.gateway.limits.keys import KeyInfo
from kvfleet.gateway.limits.rate_limit import RateLimiter, Verdict, decide
from kvfleet.local.redis_server import RedisServer

T0 = 1_700_000_000.25  # an injected clock: the tests move time by passing `now`


async def admit_many(limiter: RateLimiter, key: KeyInfo, count: int, now: float) -> list[Verdict]:
    return [await limiter.admit(key, now=now + i * 0.1) for i in range(count)]


def test_the_request_over_rpm_is_refused_until_the_window_slides(redis_server) -> None:
    async def run() -> None:
        key = KeyInfo("a1", "alice", rpm=3)
        async with Redis.from_url(redis_server.url) as redis:
            limiter = RateLimiter(redis, "chat")
            first, second, third, fourth = await admit_many(limiter, key, 4, T0)
            assert first.allowed and second.allowed and third.allowed
            assert not fourth.allowed and fourth.reason == "rpm"
            assert 1 <= fourth.retry_after_s <= 60
            assert not (await limiter.admit(key, now=T0 + fourth.retry_after_s - 2)).allowed
            assert (await limiter.admit(key, now=T0 + 0.3 + fourth.retry_after_s)).allowed
            assert not limiter.degraded

    asyncio.run(run())


def test_tokens_settled_beyond_tpm_refuse_the_next_request(redis_server) -> None:
    async def run() -> None:
        key = KeyInfo("b2", "bob", tpm=1000)
        async with Redis.from_url(redis_server.url) as redis:
            limiter = RateLimiter(redis, "chat")
            first = await limiter.admit(key, 100, now=T0)
            assert first.allowed and first.reservation.tokens == 100
            await limiter.settle(first.reservation, 600, now=T0 + 1)
            second = await limiter.admit(key, 100, now=T0 + 2)
            assert second.allowed
            await limiter.settle(second.reservation, 600, now=T0 + 3)
            refused = await limiter.admit(key, 100, now=T0 + 4)
            assert refused == Verdict(allowed=False, reason="tpm", retry_after_s=refused.retry_after_s)
            assert refused.reservation is None
            assert 1 <= refused.retry_after_s <= 60
            assert (await limiter.admit(key, 100, now=T0 + 4 + refused.retry_after_s)).allowed
            with pytest.raises(ValueError, match="non-negative"):
                await limiter.settle(second.reservation, -1)

    asyncio.run(run())


def test_two_gateway_replicas_share_the_count(redis_server) -> None:
    async def run() -> None:
        key = KeyInfo("c3", "carol", rpm=3)
        async with Redis.from_url(redis_server.url) as redis_a, Redis.from_url(redis_server.url) as redis_b:
            replica_a, replica_b = RateLimiter(redis_a, "chat"), RateLimiter(redis_b, "chat")
            other_fleet = RateLimiter(redis_b, "code")
            assert (await replica_a.admit(key, now=T0)).allowed
            assert (await replica_b.admit(key, now=T0 + 1)).allowed
            assert (await replica_a.admit(key, now=T0 + 2)).allowed
            assert (await replica_b.admit(key, now=T0 + 3)).reason == "rpm"
            assert (await other_fleet.admit(key, now=T0 + 3)).allowed
            assert (await replica_a.admit(KeyInfo("d4", "dave", tpm=10), 10, now=T0)).allowed
            assert (await replica_b.admit(KeyInfo("d4", "dave", tpm=10), 10, now=T0 + 1)).reason == "tpm"

    asyncio.run(run())


class FakeMonotonic:
    """Stands in for the limiter module's `time`, so the once-a-second Redis probe runs on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


def test_without_redis_limits_hold_locally_and_come_back_to_redis(redis_server, caplog, monkeypatch) -> None:
    clock = FakeMonotonic()
    monkeypatch.setattr(rate_limit, "time", clock)

    async def run() -> None:
        key = KeyInfo("e5", "erin", rpm=2, tpm=10_000)
        async with Redis.from_url(redis_server.url) as redis, Redis.from_url(redis_server.url) as peer_redis:
            limiter, peer = RateLimiter(redis, "chat"), RateLimiter(peer_redis, "chat")
            assert (await limiter.admit(key, now=T0)).allowed
            redis_server.stop()

            verdicts = await admit_many(limiter, key, 3, T0 + 1)
            assert limiter.degraded
            assert [v.allowed for v in verdicts] == [True, True, False]  # a fresh local window: 2 allowed
            assert verdicts[2].reason == "rpm" and 1 <= verdicts[2].retry_after_s <= 60
            reserved = await limiter.admit(KeyInfo("e6", "erin2", tpm=100), 50, now=T0 + 2)  # reserved locally
            assert reserved.allowed and reserved.reservation.local
            await limiter.settle(reserved.reservation, 80, now=T0 + 2)  # settled locally, no error
            assert (await limiter.admit(KeyInfo("e6", "erin2", tpm=100), 50, now=T0 + 3)).allowed
            assert (await limiter.admit(KeyInfo("e6", "erin2", tpm=100), 50, now=T0 + 3)).reason == "tpm"

            # stop() removes the server's data folder, so a new server takes over the same port.
            restarted = RedisServer(port=redis_server.port).start()
            try:
                clock.now = 0.5
                assert not (await limiter.admit(key, now=T0 + 3)).allowed  # no Redis probe within a second
                assert limiter.degraded
                clock.now = 1.5
                assert (await limiter.admit(key, now=T0 + 61.5)).allowed
                assert not limiter.degraded
                assert (await peer.admit(key, now=T0 + 61.6)).allowed  # the count is in Redis again
                assert (await limiter.admit(key, now=T0 + 61.7)).reason == "rpm"
            finally:
                restarted.stop()

    with caplog.at_level(logging.INFO, logger="kvfleet.gateway.limits.rate_limit"):
        asyncio.run(run())
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in messages] == ["WARNING", "INFO"], messages
    assert "unreachable" in messages[0][1] and "reachable again" in messages[1][1]


def test_a_redis_that_never_answers_costs_at_most_the_timeout() -> None:
    """A black-holed Redis: a TCP server that accepts connections and never replies."""

    async def run() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, Redis(host="127.0.0.1", port=port) as redis:
            limiter = RateLimiter(redis, "chat", timeout_s=0.2)
            started = time.monotonic()
            assert (await limiter.admit(KeyInfo("f6", "frank", rpm=1), now=T0)).allowed
            assert limiter.degraded
            assert time.monotonic() - started < 2

    asyncio.run(run())


def test_keys_without_limits_are_always_admitted() -> None:
    async def run() -> None:
        async with Redis(host="127.0.0.1", port=1) as unreachable:
            limiter = RateLimiter(unreachable, "chat")
            assert await limiter.admit(KeyInfo("g7", "grace")) == Verdict(allowed=True)
            assert not limiter.degraded  # no Redis call was needed

    asyncio.run(run())


def test_when_both_limits_bind_the_verdict_names_the_longer_wait() -> None:
    requests = {int(T0) - 50: 1, int(T0): 1}  # rpm 2: room again when the first leaves, in ~10 s
    tokens = {int(T0) - 10: 500}  # tpm 500: room again in ~50 s
    verdict = decide(requests, tokens, rpm=2, tpm=500, now=T0)
    assert verdict == Verdict(allowed=False, reason="tpm", retry_after_s=50)
    assert decide(requests, tokens, rpm=3, tpm=None, now=T0).allowed
    assert decide({}, {}, rpm=0, tpm=None, now=T0) == Verdict(allowed=False, reason="rpm", retry_after_s=60)
