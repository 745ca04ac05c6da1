"""The hostile-client catalogue: each entry is one thing an attacker can send, and the answer a user should see.

bench/abuse.py runs it against a live fleet with victims beside it; tests/test_abuse_catalogue.py runs it against
a fleet of tiny-model engines in CI. Every attack talks to the gateway only through sockets or httpx, as a client.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

Status = int | str  # an HTTP status, or "closed" / "timeout" / "error" when no status line came back


@dataclass
class Target:
    gateway_url: str
    model: str
    engine_urls: list[str] = field(default_factory=list)  # to check engine-side effects (running requests)
    log_dir: Path | None = None  # the fleet's process logs, to check what reached them


@dataclass
class Outcome:
    statuses: list[Status]
    seconds: float
    note: str = ""


@dataclass(frozen=True)
class Attack:
    name: str
    description: str
    run: Callable[[Target], Outcome]
    expected: frozenset[Status]  # every status the attacker may get; anything else is a failure
    # run once the victims are answered: what the attack left behind, as a note ("" when nothing)
    aftermath: Callable[[Target], str] | None = None

    def passed(self, outcome: Outcome) -> bool:
        """Every answer is one the user should see, and no side effect was noted."""
        return bool(outcome.statuses) and all(s in self.expected for s in outcome.statuses) and not outcome.note


def chat_body(model: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **extra}


def _timed(fn: Callable[[], list[Status]]) -> Outcome:
    start = time.monotonic()
    statuses = fn()
    return Outcome(statuses, time.monotonic() - start)


def post(target: Target, body: bytes | dict, path: str = "/v1/chat/completions", headers: dict | None = None,
         timeout: float = 30.0) -> Status:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        r = httpx.post(target.gateway_url + path, content=content, timeout=timeout,
                       headers={"content-type": "application/json", **(headers or {})})
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError:
        return "closed"
    return r.status_code


def raw_exchange(url: str, head: bytes, body: bytes = b"", timeout: float = 30.0, chunk_delay: float = 0.0
                 ) -> Status:
    """Send bytes as they are (headers an HTTP library would refuse to build) and read the status line."""
    parsed = urllib.parse.urlsplit(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout) as sock:
        try:
            if chunk_delay:
                for i in range(len(head)):
                    sock.sendall(head[i:i + 1])
                    time.sleep(chunk_delay)
            else:
                sock.sendall(head + body)
        except OSError:
            pass  # the server may answer and close before it has read everything: read what it said
        try:
            reply = sock.recv(64)
        except TimeoutError:
            return "timeout"
        except OSError:
            return "closed"
    if not reply.startswith(b"HTTP/1.1 "):
        return "closed"
    return int(reply[9:12])


def _head(target: Target, extra_headers: bytes, body: bytes) -> bytes:
    host = urllib.parse.urlsplit(target.gateway_url).netloc.encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host + b"\r\ncontent-type: application/json\r\n"
            + extra_headers + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")


def header_flood(count: int) -> Callable[[Target], Outcome]:
    def run(target: Target) -> Outcome:
        body = json.dumps(chat_body(target.model)).encode()
        extra = b"".join(b"x-flood-%d: %d\r\n" % (i, i) for i in range(count))
        return _timed(lambda: [raw_exchange(target.gateway_url, _head(target, extra, body), body)])
    return run


def huge_header(size: int) -> Callable[[Target], Outcome]:
    def run(target: Target) -> Outcome:
        body = json.dumps(chat_body(target.model)).encode()
        extra = b"x-big: " + b"a" * size + b"\r\n"
        return _timed(lambda: [raw_exchange(target.gateway_url, _head(target, extra, body), body)])
    return run


def slowloris(target: Target) -> Outcome:
    """Headers sent one byte every 0.2 s: the server must cut the connection off, not wait for ever."""
    body = json.dumps(chat_body(target.model)).encode()
    head = _head(target, b"x-slow: " + b"s" * 400 + b"\r\n", body)
    return _timed(lambda: [raw_exchange(target.gateway_url, head, body, timeout=60.0, chunk_delay=0.2)])


def single(body_of: Callable[[Target], bytes | dict], path: str = "/v1/chat/completions",
           headers: dict | None = None, repeat: int = 1) -> Callable[[Target], Outcome]:
    def run(target: Target) -> Outcome:
        return _timed(lambda: [post(target, body_of(target), path, headers) for _ in range(repeat)])
    return run


def several(*bodies: Callable[[Target], dict]) -> Callable[[Target], Outcome]:
    def run(target: Target) -> Outcome:
        return _timed(lambda: [post(target, body(target)) for body in bodies])
    return run


def nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def surrogate_body(target: Target) -> bytes:
    # json.dumps would escape the surrogate itself; a client can send the escape sequence as is
    return (b'{"model": "' + target.model.encode() + b'", "max_tokens": 4, '
            b'"messages": [{"role": "user", "content": "hi \\ud800 there"}]}')


def surrogate_stop_body(target: Target) -> bytes:
    return (b'{"model": "' + target.model.encode() + b'", "max_tokens": 4, "stop": "\\udfff", '
            b'"messages": [{"role": "user", "content": "hi"}]}')


def huge_prompt(target: Target) -> dict:
    return chat_body(target.model, messages=[{"role": "user", "content": "word " * (6 * 1024 * 1024 // 5)}])


def abandoned(target: Target) -> Outcome:
    """A non-streaming request for 2,000 tokens whose client hangs up after 0.5 s."""
    body = chat_body(target.model, max_tokens=2000, ignore_eos=True)
    start = time.monotonic()
    try:
        httpx.post(target.gateway_url + "/v1/chat/completions", json=body, timeout=0.5)
        status: Status = "answered"
    except httpx.TimeoutException:
        status = "hung up"
    return Outcome([status], time.monotonic() - start)


def engines_drop_abandoned_work(target: Target) -> str:
    """Once the victims are answered, the engines must be idle within 3 s: the hung-up request was dropped."""
    return "" if _wait_engines_idle(target.engine_urls, 3.0) else "engines still ran the abandoned request"


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=2.0).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvfleet_num_requests_running"))


def _wait_engines_idle(urls: list[str], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if all(_running(url) == 0 for url in urls):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def log_injection(target: Target) -> Outcome:
    """Unknown field names with a newline are served, and no log line starts with the forged text."""
    outcome = _timed(lambda: [post(target, chat_body(target.model, **{"x\nFORGED LOG LINE": 1}))])
    if target.log_dir is not None:
        time.sleep(0.5)  # the request's log line is written as it finishes
        for log in target.log_dir.glob("*.log"):
            if any(line.startswith("FORGED LOG LINE") for line in log.read_text(errors="replace").splitlines()):
                outcome.note = f"{log.name} holds a forged line"
    return outcome


CATALOGUE: list[Attack] = [
    Attack("seed 2**64", "seed one past 64 bits", single(lambda t: chat_body(t.model, seed=2**64)),
           frozenset({400})),
    Attack("seed 2**64-1", "the largest valid seed: served", single(lambda t: chat_body(t.model, seed=2**64 - 1)),
           frozenset({200})),
    Attack("top_k 10**12", "top_k beyond the vocabulary", single(lambda t: chat_body(t.model, top_k=10**12)),
           frozenset({400})),
    Attack("n 10**6", "a million choices", single(lambda t: chat_body(t.model, n=10**6)), frozenset({400})),
    Attack("max_tokens 2**63", "an integer extreme", single(lambda t: chat_body(t.model, max_tokens=2**63)),
           frozenset({400})),
    Attack("stop_token_ids 10**12", "a token id beyond the vocabulary",
           single(lambda t: chat_body(t.model, stop_token_ids=[10**12])), frozenset({400})),
    Attack("logprobs 10**9", "completions logprobs far over 20",
           single(lambda t: {"model": t.model, "prompt": "hi", "max_tokens": 2, "logprobs": 10**9},
                  path="/v1/completions"), frozenset({400})),
    Attack("lone surrogate", "\\ud800 in a message", single(surrogate_body, repeat=3), frozenset({400})),
    Attack("lone surrogate stop", "\\udfff as a stop string", single(surrogate_stop_body), frozenset({400})),
    Attack("wrong types", 'stream "yes", max_tokens "4" and true, n "2"',
           several(lambda t: chat_body(t.model, stream="yes"), lambda t: chat_body(t.model, max_tokens="4"),
                   lambda t: chat_body(t.model, max_tokens=True), lambda t: chat_body(t.model, n="2")),
           frozenset({400})),
    Attack("deep nesting", "JSON nested 100,000 deep", single(lambda t: nested(100_000)), frozenset({400})),
    Attack("invalid JSON", "a body that is not JSON", single(lambda t: b"{not json"), frozenset({400})),
    Attack("huge prompt x4", "four 6 MiB prompts (under the body limit)", single(huge_prompt, repeat=4),
           frozenset({400})),
    Attack("huge body", "a 20 MiB body", single(lambda t: b'{"x": "' + b"a" * (20 << 20) + b'"}'),
           frozenset({413})),
    Attack("bad priority header", "x-kvfleet-priority: urgent!!",
           single(lambda t: chat_body(t.model), headers={"x-kvfleet-priority": "urgent!!"}), frozenset({400})),
    Attack("body priority -100", "a sheddable request asking the engine for priority -100",
           single(lambda t: chat_body(t.model, priority=-100), headers={"x-kvfleet-priority": "sheddable"}),
           frozenset({200, 429})),
    Attack("unknown fields", "field names with newlines (log injection)",
           log_injection, frozenset({200})),
    Attack("20k headers", "20,000 request headers", header_flood(20_000), frozenset({431, "closed"})),
    Attack("100k headers", "100,000 request headers", header_flood(100_000), frozenset({431, "closed"})),
    Attack("32 MiB header", "one 32 MiB header value", huge_header(32 << 20), frozenset({431, "closed"})),
    Attack("slowloris", "headers at one byte per 0.2 s", slowloris, frozenset({408, "closed"})),
    Attack("abandoned request", "client hangs up on a 2,000-token non-streaming answer", abandoned,
           frozenset({"hung up"}), aftermath=engines_drop_abandoned_work),
]
