"""Failures behind the gateway: an engine dying mid-stream or between requests, and Redis going away and back.
Real engine processes, real gateways and a real Redis server; failures are real kills."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import process_output, start_engine_servers, start_gateway, stop_process
from tests.support.gateways import until_metric, wait_until_routable

# How the client sees a stream its engine broke after the answer began, with no other engine to continue it on
# (tests/gateway/test_stream_migration.py has the continuation): an OpenAI error event, then [DONE], on both data
# planes (Envoy's goes through the gateway's app, envoy/handoff.py). Never a clean end that looks like success.
BROKEN_STREAM = (openai.APIError, "failed mid-stream")


@pytest.mark.parametrize("plane", ["envoy", "python"])
def test_an_engine_that_dies_mid_stream_breaks_the_stream_visibly(tiny_model_dir, plane: str) -> None:
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ("--max-model-len", "1024",
                                                                   "--kv-cache-memory", "32MiB"))
    gateway, url = start_gateway("--engine", engine_url, "--data-plane", plane)
    try:
        wait_until_routable(url)
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="tell a long story", max_tokens=900, stream=True,
                                           extra_body={"ignore_eos": True})
        received = 0
        started = time.monotonic()
        error, message = BROKEN_STREAM
        with pytest.raises(error, match=message):
            for _ in stream:
                received += 1
                if received == 3:
                    engine.send_signal(signal.SIGKILL)
        assert received >= 3 and time.monotonic() - started < 20  # an error, not a hang
        until_metric(url, 'kvfleet_gateway_requests_total{code="200",priority="standard"} 1.0')
    finally:
        stop_process(gateway)
        stop_process(engine)


def test_requests_to_a_dead_engine_are_retried_elsewhere_and_the_engine_is_ejected(tiny_model_dir) -> None:
    (a, url_a), (b, url_b) = start_engine_servers(tiny_model_dir, (), ())
    # Round-robin ignores load, and a long scrape interval (with metrics allowed to age as long) keeps the dead
    # engine looking healthy, so requests really are sent to it and must be retried: the gateway learns of the
    # death only from the failures.
    gateway, url = start_gateway("--engine", url_a, "--engine", url_b, "--routing", "round-robin",
                                 "--scrape-interval-ms", "10000", "--max-metrics-age-ms", "60000",
                                 "--eject-after-failures", "2")
    try:
        wait_until_routable(url, 2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        a.send_signal(signal.SIGKILL)
        a.wait()
        served = []
        for i in range(8):
            r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": f"q{i}", "max_tokens": 3},
                           timeout=30)
            assert r.status_code == 200, r.text
            served.append(r.headers["x-kvfleet-engine"])
        assert served == [url_b] * 8
        until_metric(url, f'kvfleet_gateway_ejections_total{{endpoint="{url_a}"}} 1.0')
        # every request's own end counted too: behind Envoy an attempt's entry (ejection) and the request's entry
        # (its retry) can reach the gateway in different flushes
        metrics = until_metric(url, 'kvfleet_gateway_requests_total{code="200",priority="standard"} 8.0')
        retried = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("kvfleet_gateway_retries_total"))
        # two failures, then A is ejected and no longer tried; behind Envoy the failures reach the picker in its
        # access log (a quarter-second flush), so requests sent meanwhile may try A first too
        assert 2 <= retried <= 4
    finally:
        stop_process(gateway)
        stop_process(a)
        stop_process(b)


def test_redis_killed_and_restarted_the_gateway_keeps_serving_and_goes_back(tiny_model_dir, redis_server) -> None:
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ())
    gateway, url = start_gateway("--engine", engine_url, "--redis-url", redis_server.url, "--fleet", "r")
    body = {"prompt": "hello", "max_tokens": 3}
    try:
        wait_until_routable(url)
        body["model"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        assert httpx.get(f"{url}/ready").json()["queue"] == "redis"
        redis_server.proc.send_signal(signal.SIGKILL)
        redis_server.proc.wait()
        for _ in range(5):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/ready").json()["queue"] != "local" and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 200 and ready.json()["queue"] == "local"
        assert "Redis unreachable" in ready.json()["redis"]
        assert "kvfleet_gateway_redis_up 0.0" in httpx.get(f"{url}/metrics").text
        redis_server.start()  # the same port, empty
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/ready").json()["queue"] != "redis" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/ready").json()["queue"] == "redis"
        assert "kvfleet_gateway_redis_up 1.0" in httpx.get(f"{url}/metrics").text
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        stop_process(gateway)
        print(process_output(gateway))  # shown when the test fails
        stop_process(engine)


# ---- engines that stop answering, clients that leave, and the engines' shared token ------------------------------
ENGINE_KEY = "engine-shared-token-0123456789"


class BlackholeProxy:
    """A TCP proxy on loopback in front of a real engine; `blackhole()` makes it an engine that stops answering
    without closing anything: it keeps accepting and reading, and forwards nothing either way."""

    def __init__(self, upstream: str) -> None:
        import socket
        import threading

        self.upstream = upstream.removeprefix("http://").split(":")
        self.holed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def blackhole(self) -> None:
        self.holed.set()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = None if self.holed.is_set() else socket.create_connection(
                (self.upstream[0], int(self.upstream[1])))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            if server is not None:
                threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _pump(self, source, target) -> None:
        try:
            while data := source.recv(65536):
                if target is not None and not self.holed.is_set():
                    target.sendall(data)
        except OSError:
            pass  # held sockets are never closed by this side: that is the blackhole

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir):
    """A real engine that requires the shared token on /v1/*, with room for long answers."""
    [(engine, url)] = start_engine_servers(tiny_model_dir, ("--max-model-len", "1024", "--kv-cache-memory", "32MiB",
                                                            "--api-key", ENGINE_KEY))
    yield url
    stop_process(engine)


def engine_metric(engine_url: str, name: str) -> float:
    text = httpx.get(f"{engine_url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("migration", ["on", "off"])
def test_an_engine_that_stops_answering_is_timed_out_ejected_and_clients_are_answered(keyed_engine: str,
                                                                                      migration: str) -> None:
    """The Python proxy's own first-byte and idle timers (Envoy has one idle timer per stream, the largest of them:
    gateway/envoy_config.stream_silence_s; behind Envoy a blackhole is found by its silent /metrics, next test).
    The stream cut by the blackhole goes on on the other engine (migration, on by default); with migration off
    (--migration-limit 0) it ends in an error event that says the output is incomplete."""
    proxy = BlackholeProxy(keyed_engine)
    # Round-robin sends every other request through the proxy; metrics allowed to age long keep the blackholed
    # engine looking routable, so only the request timeouts can find it out.
    gateway, url = start_gateway("--engine", proxy.url, "--engine", keyed_engine, "--routing", "round-robin",
                                 "--engine-api-key", ENGINE_KEY, "--upstream-first-byte-timeout", "2",
                                 "--upstream-idle-timeout", "1", "--eject-after-failures", "2",
                                 "--scrape-interval-ms", "10000", "--max-metrics-age-ms", "60000",
                                 "--data-plane", "python", *(["--migration-limit", "0"] if migration == "off" else []))
    body = {"model": "m", "prompt": "tell a long story", "max_tokens": 60, "stream": True, "ignore_eos": True}
    try:
        wait_until_routable(url, 2)
        body["model"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for _ in range(4):  # until a stream goes through the proxy; cut it there after its first events
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                through_proxy = r.headers["x-kvfleet-engine"] == proxy.url
                events, after_cut = [], []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if proxy.holed.is_set():
                            after_cut.append(time.monotonic())
                    if through_proxy and len(events) == 2 and not proxy.holed.is_set():
                        proxy.blackhole()
                        after_cut.append(time.monotonic())
            if through_proxy:
                break
        # not a hang: the idle gap is 1 s, then the error event or the continuation's first token (however long the
        # rest of the answer takes on a loaded machine)
        assert through_proxy and max(b - a for a, b in zip(after_cut, after_cut[1:], strict=False)) < 10
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        if migration == "off":
            assert last["error"]["code"] == "upstream_timeout"
        else:  # finished on the other engine: every token asked for, one answer
            chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
            assert all("error" not in c for c in chunks) and last["choices"][0]["finish_reason"] == "length"
            assert len({c["id"] for c in chunks}) == 1 and "token_ids" not in str(chunks)
        for i in range(4):
            started = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", json={"model": body["model"], "prompt": f"q{i}",
                                                          "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvfleet-engine"] == keyed_engine
            assert time.monotonic() - started < 6
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvfleet_gateway_ejections_total{{endpoint="{proxy.url}"}} 1.0' in metrics
        continued = 'kvfleet_gateway_migrations_total{cause="timeout",outcome="continued"} 1.0' in metrics
        assert continued == (migration == "on")
    finally:
        stop_process(gateway)
        proxy.close()


@pytest.mark.parametrize("plane", ["envoy", "python"])
def test_with_default_timeouts_an_engine_whose_metrics_go_silent_is_dropped_in_seconds(keyed_engine: str,
                                                                                       plane: str) -> None:
    """The long default timeouts stay (a queued request may wait minutes for its first token); an engine whose
    /metrics stops answering for 10 s (--engine-unreachable-after) is what ends the waits on it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    proxy = BlackholeProxy(keyed_engine)
    gateway, url = start_gateway("--engine", proxy.url, "--engine-api-key", ENGINE_KEY, "--data-plane", plane)
    try:
        wait_until_routable(url)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

        started = threading.Event()

        def stream_events() -> list[str]:
            body = {"model": model, "prompt": "tell a long story", "max_tokens": 200, "stream": True,
                    "ignore_eos": True}
            events = []
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line)
                            started.set()
            except httpx.RemoteProtocolError:  # a reset: the client would not know the output is incomplete
                events.append("reset")
            return events

        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(stream_events)
            assert started.wait(30)
            proxy.blackhole()
            holed_at = time.monotonic()
            events = in_flight.result(timeout=60)
        ended_in = time.monotonic() - holed_at
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "upstream_timeout"
        assert events[-1] == "data: [DONE]"
        assert ended_in < 18  # 10 s, one scrape timeout, a busy machine
        ready = httpx.get(f"{url}/ready").json()
        assert ready["healthy"] == 0 and ready["available"] == 0
    finally:
        stop_process(gateway)
        proxy.close()


def test_a_client_that_leaves_a_non_streaming_request_stops_the_engine_work(keyed_engine: str) -> None:
    import socket

    gateway, url = start_gateway("--engine", keyed_engine, "--engine-api-key", ENGINE_KEY)
    try:
        wait_until_routable(url)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        deadline = time.monotonic() + 30  # work that earlier tests abandoned at a proxy may still be finishing
        while engine_metric(keyed_engine, "kvfleet_num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.1)
        generated = engine_metric(keyed_engine, "kvfleet_generation_tokens_total")
        payload = json.dumps({"model": model, "prompt": "tell a long story", "max_tokens": 900,
                              "ignore_eos": True}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            time.sleep(0.5)
            deadline = time.monotonic() + 10  # a busy machine may take a moment to admit it
            while engine_metric(keyed_engine, "kvfleet_num_requests_running") != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine_metric(keyed_engine, "kvfleet_num_requests_running") == 1
        left = time.monotonic()
        while engine_metric(keyed_engine, "kvfleet_num_requests_running") and time.monotonic() - left < 5:
            time.sleep(0.05)
        assert time.monotonic() - left < 2
        assert engine_metric(keyed_engine, "kvfleet_generation_tokens_total") - generated < 900  # aborted early
    finally:
        stop_process(gateway)


def test_the_gateway_sends_the_engine_token_never_the_clients_credentials(keyed_engine: str) -> None:
    with_key, url = start_gateway("--engine", keyed_engine, "--engine-api-key", ENGINE_KEY)
    without_key, bare_url = start_gateway("--engine", keyed_engine)
    try:
        wait_until_routable(url)
        wait_until_routable(bare_url)
        client = OpenAI(base_url=f"{url}/v1", api_key="a-client-key-the-engine-would-refuse", max_retries=0)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].text is not None
        bare = OpenAI(base_url=f"{bare_url}/v1", api_key=ENGINE_KEY, max_retries=0)  # the client's own header
        with pytest.raises(openai.AuthenticationError):
            bare.completions.create(model=model, prompt="hi", max_tokens=2)
        assert httpx.get(f"{bare_url}/ready").json()["available"] == 1  # the engine's 401 ejected nothing
    finally:
        stop_process(with_key)
        stop_process(without_key)
