"""Failure classes: only an engine's own faults are retried elsewhere and count toward ejection.

The engines here are stand-ins: small HTTP servers on loopback, written in this file, that answer as a faulty engine
would. They stand in because the real engine no longer answers an unmarked 500 for any input (that is the point of
issue 13), yet a gateway must stay safe in front of engines that still do (older kvfleet, vLLM builds, a crash in a
handler), and because a real engine cannot be made to end a stream without [DONE] on demand. The gateway under test
is a real `kvfleet gateway` process.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvfleet.gateway.engines.failure_class import FAULT_HEADER, AnswerClass, classify
from tests.conftest import start_gateway, stop_process
from tests.test_gateway_proxy import until_metric, wait_until_routable

METRICS = b"kvfleet_kv_cache_usage 0.1\nkvfleet_num_requests_waiting 0\nkvfleet_num_requests_running 0\n"


def error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}).encode()


class StandInEngine:
    """Answers by the prompt: `poison-500` an unmarked 500, `poison-400` a 400, `truncate` a stream cut short
    without [DONE]; anything else a normal completion. `broken` makes every completion a marked engine fault."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.broken = False
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    self.answer(200, METRICS, "text/plain")
                else:
                    self.answer(200, b'{"object": "list", "data": [{"id": "stand-in", "object": "model"}]}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                prompt = body.get("prompt", "")
                engine.prompts.append(prompt)
                if engine.broken:
                    self.answer(500, error_body("the engine thread died"), fault=True)
                elif prompt == "poison-500":
                    self.answer(500, error_body("tokenizer exploded on this input"))
                elif prompt == "poison-400":
                    self.answer(400, error_body("prompt: not valid Unicode"))
                elif prompt == "truncate":
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("connection", "close")
                    self.end_headers()
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "Once"}]}\n\n')
                    self.close_connection = True  # ends the body by closing: no [DONE], no error
                else:
                    self.answer(200, json.dumps({"object": "text_completion", "choices": [
                        {"index": 0, "text": "ok", "finish_reason": "length"}]}).encode())

            def answer(self, status: int, body: bytes, media: str = "application/json", fault: bool = False) -> None:
                self.send_response(status)
                self.send_header("content-type", media)
                self.send_header("content-length", str(len(body)))
                if fault:
                    self.send_header("x-kvfleet-fault", "engine")
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "stand-in", "prompt": prompt, **extra}, timeout=30)


def counter(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


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
