"""Failure classes: only an engine's own faults are retried elsewhere and count toward ejection.

The engines here are stand-ins: small HTTP servers on loopback, written in this file, that answer as a faulty engine
would. They stand in because the real engine no longer answers an unmarked 500 for any input (that is the point of
issue 13), yet a gateway must stay safe in front of engines that still do (older kvfleet, vLLM builds, a crash in a
handler), and because a real engine cannot be made to end a stream without [DONE] on demand. The gateway under test
is a real `kvfleet gateway` process.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvfleet.gateway.engines.failure_class import FAULT_HEADER, AnswerClass, classify
from tests.conftest import start_gateway, stop_process
from tests.support.gateways import (
    counter,  # noqa: F401
    until_metric,
    wait_until_routable,
)
from tests.support.stand_in_engine import StandInEngine, complete


@pytest.fixture
def fleet():
    engines = [StandInEngine(), StandInEngine()]
    # Round-robin spreads requests over both; two failures in a row would eject an engine.
    gateway, url = start_gateway(*(a for e in engines for a in ("--engine", e.url)), "--routing", "round-robin",
                                 "--eject-after-failures", "2")
    wait_until_routable(url, 2)
    yield url, engines
    stop_process(gateway)
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("prompt,status,message", [("poison-500", 500, "tokenizer exploded"),
                                                    ("poison-400", 400, "not valid Unicode")])
def test_an_answer_the_request_caused_is_returned_once_and_ejects_nothing(fleet, prompt: str, status: int,
                                                                         message: str) -> None:
    url, engines = fleet
    for _ in range(6):
        r = complete(url, prompt)
        assert r.status_code == status and message in r.json()["error"]["message"]
    assert sum(e.prompts.count(prompt) for e in engines) == 6  # never retried on the other engine
    metrics = httpx.get(f"{url}/metrics").text
    assert counter(metrics, "kvfleet_gateway_ejections_total") == 0
    assert counter(metrics, "kvfleet_gateway_retries_total") == 0
    assert httpx.get(f"{url}/ready").json()["available"] == 2
    served = {complete(url, "hello").headers["x-kvfleet-engine"] for _ in range(4)}
    assert served == {e.url for e in engines}  # healthy traffic still reaches both engines


def test_an_engine_fault_is_retried_elsewhere_and_ejects_the_engine(fleet) -> None:
    url, (broken, healthy) = fleet
    broken.broken = True
    for i in range(6):
        r = complete(url, f"q{i}")
        assert r.status_code == 200 and r.headers["x-kvfleet-engine"] == healthy.url
    # two faults, then it is ejected and no longer tried; behind Envoy the faults reach the picker in its access
    # log (a quarter-second flush), so a request sent meanwhile may try it once more
    assert 2 <= len(broken.prompts) <= 3
    until_metric(url, f'kvfleet_gateway_ejections_total{{endpoint="{broken.url}"}} 1.0')


def test_a_stream_that_ends_without_done_ends_with_an_error_event(fleet) -> None:
    """The Python proxy reads every event, so it can tell a stream an engine ended early; Envoy carries the bytes
    unread, and a stream an engine closes cleanly without [DONE] reaches the client as the engine sent it
    (docs/security.md: kvfleet's engines and vLLM end every stream with [DONE] or an error event)."""
    _, engines = fleet
    gateway, url = start_gateway(*(a for e in engines for a in ("--engine", e.url)), "--data-plane", "python")
    try:
        wait_until_routable(url, 2)
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": "stand-in", "prompt": "truncate",
                                                                   "stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        stop_process(gateway)
    assert r.status_code == 200 and events[0].startswith('data: {"choices"')
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "stream_truncated" and "incomplete" in error["message"]
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize("status,headers,expected", [
    (200, {}, AnswerClass.OK),
    (400, {}, AnswerClass.REQUEST),
    (404, {FAULT_HEADER: "engine"}, AnswerClass.REQUEST),  # a 4xx is the request's, whatever it says
    (500, {}, AnswerClass.REQUEST),
    (500, {FAULT_HEADER: "engine"}, AnswerClass.FAULT),
    (501, {FAULT_HEADER: "Engine "}, AnswerClass.FAULT),
    (502, {}, AnswerClass.FAULT),
    (504, {}, AnswerClass.FAULT),
    (503, {}, AnswerClass.BUSY),
    (503, {FAULT_HEADER: "engine"}, AnswerClass.FAULT),
    (429, {}, AnswerClass.BUSY),
])
def test_the_failure_classes(status: int, headers: dict, expected: AnswerClass) -> None:
    assert classify(status, headers) is expected


def test_an_unreachable_engine_ends_only_the_waits_that_saw_nothing_for_as_long() -> None:
    """A stream still receiving chunks from an engine that is only slow to report its metrics is left alone."""
    import asyncio

    from kvfleet.gateway.engines.pool import EndpointPool

    async def scenario() -> dict[str, str]:
        pool, outcome = EndpointPool(), {}
        pool.set_urls({"http://a"})

        async def wait_on_engine(name: str) -> None:
            try:
                async with asyncio.timeout(5) as wait:
                    pool.watch("http://a", wait)
                    try:
                        await asyncio.sleep(0.6)  # the engine's answer arrives after this
                    finally:
                        pool.unwatch("http://a", wait)
                outcome[name] = "answered"
            except TimeoutError:
                outcome[name] = "ended"

        silent = asyncio.create_task(wait_on_engine("silent for 0.3 s"))
        await asyncio.sleep(0.3)
        fresh = asyncio.create_task(wait_on_engine("a chunk just arrived"))
        await asyncio.sleep(0)
        assert pool.mark_unreachable("http://a", "/metrics has not answered for 3 s", silent_s=0.2) == 1
        await asyncio.gather(silent, fresh)
        assert "has not answered" in pool.endpoints["http://a"].scrape_error  # unhealthy until a scrape answers
        return outcome

    assert asyncio.run(scenario()) == {"silent for 0.3 s": "ended", "a chunk just arrived": "answered"}
