"""Fault drills: real engines, gateways and Redis killed or hung while requests are in flight or queued, and
what every client sees. Each drill is bounded in time: a request that hangs fails the drill."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from kvfleet.fleet.redis_keys import heartbeat_key, key_prefix, queue_entries_key, queue_key, queue_leases_key
from tests.conftest import process_output, start_engine_servers, start_gateway, stop_process
from tests.support.blackhole_proxy import BlackholeProxy
from tests.support.clients import complete, finished, is_openai_error
from tests.support.engines import LONG, running, saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """A one-sequence-at-a-time engine (easy to saturate) and a wide one (the survivor in engine drills)."""
    (narrow, narrow_url), (wide, wide_url) = start_engine_servers(tiny_model_dir, ("--max-num-seqs", "1", *LONG),
                                                                  LONG)
    yield narrow_url, wide_url
    stop_process(narrow)
    stop_process(wide)


@pytest.fixture(scope="module")
def model(engines) -> str:
    return httpx.get(f"{engines[0]}/v1/models").json()["data"][0]["id"]


def stream(gateway: str, model: str, prompt: str, first: threading.Event, timeout: float = 60,
           max_tokens: int = 400, arrivals: list[float] | None = None) -> tuple[str, str, float]:
    """A streaming request read as raw SSE; returns (serving engine, how it ended, when it ended). `arrivals`: gets
    each event's arrival time."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    engine = ""
    try:
        with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=timeout) as r:
            engine = r.headers.get("x-kvfleet-engine", "")
            for line in r.iter_lines():
                first.set()
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if arrivals is not None:
                        arrivals.append(time.monotonic())
    except httpx.HTTPError as err:
        first.set()
        return engine, f"client error {type(err).__name__}", time.monotonic()
    return engine, stream_ending(lines), time.monotonic()


def stream_ending(data: list[str]) -> str:
    """'finished' (a finish_reason, then [DONE]), 'error' (an OpenAI error event, then [DONE]), 'bare [DONE]'
    (truncated, indistinguishable from success: the bug), or 'cut' (no [DONE])."""
    if not data or data[-1] != "[DONE]":
        return "cut"
    if len(data) >= 2 and "error" in json.loads(data[-2]):
        error = json.loads(data[-2])["error"]
        return "error" if {"message", "type", "param", "code"} <= error.keys() else "malformed error"
    finished = any(c.get("finish_reason") for d in data[:-1] for c in json.loads(d).get("choices", []))
    return "finished" if finished else "bare [DONE]"


class RoundRobinTurns:
    """Places requests on a chosen engine through a round-robin gateway over two engines: the turn alternates with
    each request the gateway dispatches, so a short filler request moves it on."""

    def __init__(self, gateway: str, model: str, engines: tuple[str, str]):
        self.gateway, self.model, self.engines = gateway, model, engines
        r, _ = complete(gateway, model, "whose turn", 2)
        self.turn = self._other(r.headers["x-kvfleet-engine"])

    def _other(self, engine: str) -> str:
        return self.engines[1] if engine == self.engines[0] else self.engines[0]

    def turn_to(self, engine: str) -> None:
        if self.turn != engine:
            r, _ = complete(self.gateway, self.model, "filler", 2)
            assert r.status_code == 200 and r.headers["x-kvfleet-engine"] == self.turn, r
            self.turn = engine

    def sent(self) -> None:
        self.turn = self._other(self.turn)


# ---- drill 1 ------------------------------------------------------------------------------------------------
def test_redis_killed_while_requests_wait_in_its_queue(engines, model, redis_server) -> None:
    narrow, _ = engines
    gateway, url = start_gateway("--engine", narrow, "--redis-url", redis_server.url, "--fleet", "drill-redis",
                                 "--saturation-queue", "1")
    fleet_queue = redis.Redis.from_url(redis_server.url)
    try:
        wait_until_routable(url)
        with ThreadPoolExecutor(8) as pool:
            with saturated(narrow, model, (url,)):
                patient = [pool.submit(complete, url, model, f"p{i}", 8, 40, **{"x-kvfleet-max-queue-ms": "20000"})
                           for i in range(4)]
                short = pool.submit(complete, url, model, "short", 8, 40, **{"x-kvfleet-max-queue-ms": "1500"})
                until(lambda: fleet_queue.zcard(queue_key("drill-redis")) == 5, "the requests never queued in Redis")
                redis_server.proc.send_signal(signal.SIGKILL)
                redis_server.proc.wait()
                until(lambda: httpx.get(f"{url}/ready").json()["queue"] == "local", "never fell back", 5)
                short_answer, short_waited = short.result(timeout=10)
                later = pool.submit(complete, url, model, "after the kill", 8, 40)  # queues in the process
                until(lambda: httpx.get(f"{url}/ready").json()["queued"] == 5, "the later request did not queue")
            answers = [f.result(timeout=40) for f in [*patient, later]]
        # its deadline passed while Redis was dead (the engine stays saturated for seconds): a clear 503, on time
        assert short_answer.status_code == 503, short_answer.text
        assert short_answer.json()["error"]["code"] == "queue_timeout"
        assert int(short_answer.headers["retry-after"]) >= 1 and short_waited < 1.5 + 2.0
        for r, took in answers:  # nothing lost, nothing hung: served once the engine had room
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            assert r.json()["usage"]["completion_tokens"] == 8 and took < 20 + 5
        ready = httpx.get(f"{url}/ready").json()
        assert ready["queue"] == "local" and ready["queued"] == 0 and "Redis unreachable" in ready["redis"]
    finally:
        stop_process(gateway)
        print(process_output(gateway))


# ---- drill 2 ------------------------------------------------------------------------------------------------
def test_an_engine_killed_mid_batch(engines, model, tiny_model_dir) -> None:
    _, survivor = engines
    [(victim, victim_url)] = start_engine_servers(tiny_model_dir, LONG)
    gateway, url = start_gateway("--engine", victim_url, "--engine", survivor, "--routing", "round-robin")
    try:
        wait_until_routable(url, 2)
        turns = RoundRobinTurns(url, model, (victim_url, survivor))
        with ThreadPoolExecutor(4) as pool:
            streams, plain = [], []
            for i, kind in enumerate("snsn"):  # two streams and two non-streams running on the victim
                turns.turn_to(victim_url)
                if kind == "s":  # mid-stream: its first chunk came (before it, the gateway may still retry)
                    first = threading.Event()
                    streams.append(pool.submit(stream, url, model, f"s{i}", first, 60, 1000))
                    assert first.wait(30), "the stream never started"
                else:
                    # a not-a-hang bound, long: a loaded machine (a full run beside other work) took over 60 s
                    plain.append(pool.submit(complete, url, model, f"n{i}", 300, 240))
                until(lambda n=i + 1: running(victim_url) == n, "the request never ran on the victim")
                turns.sent()
            victim.send_signal(signal.SIGKILL)
            stream_results = [f.result(timeout=90) for f in streams]
            plain_results = [f.result(timeout=300) for f in plain]
        # its streams go on on the survivor from their exact token (migration, on by default on both data planes)
        assert [(engine, ending) for engine, ending, _ in stream_results] == [(victim_url, "finished")] * 2
        outcomes = [(r.status_code, r.headers.get("x-kvfleet-engine")) for r, _ in plain_results]
        print(f"non-streams on the killed engine: {outcomes}")
        for r, _ in plain_results:  # retried on the survivor before any byte came back, or a clear error
            assert isinstance(r, httpx.Response), r
            assert (r.status_code == 200 and r.headers["x-kvfleet-engine"] == survivor) or (
                r.status_code in (502, 503) and is_openai_error(r)), (r.status_code, r.text)
        until(lambda: httpx.get(f"{url}/ready").json()["healthy"] == 1, "the dead engine still looks healthy", 5)
        later = [complete(url, model, f"later {i}", 4) for i in range(4)]
        assert [(r.status_code, r.headers["x-kvfleet-engine"]) for r, _ in later] == [(200, survivor)] * 4
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvfleet_gateway_ejections_total{{endpoint="{victim_url}"}} 1.0' in metrics
        continued = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("kvfleet_gateway_migrations_total{") and 'outcome="continued"' in line]
        assert sum(continued) == 2, metrics  # the connection broke (error) or ended without [DONE] (broken)
    finally:
        stop_process(gateway)
        stop_process(victim)


# ---- drill 3 ------------------------------------------------------------------------------------------------
def test_a_gateway_replica_killed_while_its_requests_wait_in_redis(engines, model, redis_server) -> None:
    narrow, _ = engines
    fleet = "drill-replica"
    args = ("--engine", narrow, "--redis-url", redis_server.url, "--fleet", fleet, "--saturation-queue", "1")
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    doomed, doomed_url = start_gateway(*args)
    [doomed_id] = [k.rsplit(":", 1)[1] for k in store.keys(key_prefix(fleet) + "gateway:*")]
    survivor = None

    def doomed_entries() -> int:
        entries = store.hgetall(key_prefix(fleet) + "queue:entries")
        return sum(meta.startswith(f"{doomed_id}|") for meta in entries.values())
    try:
        survivor, survivor_url = start_gateway(*args)
        wait_until_routable(doomed_url)
        wait_until_routable(survivor_url)
        with ThreadPoolExecutor(8) as pool:
            with saturated(narrow, model, (doomed_url, survivor_url), holders=5):
                mine, theirs = [], []
                for i in range(3):  # interleaved: the survivor's entries sit behind the doomed replica's
                    theirs.append(pool.submit(complete, doomed_url, model, f"d{i}", 8, 40))
                    until(lambda n=2 * i + 1: store.zcard(queue_key(fleet)) == n, f"d{i} never queued")
                    mine.append(pool.submit(finished, complete, survivor_url, model, f"s{i}", 8, 40))
                    until(lambda n=2 * i + 2: store.zcard(queue_key(fleet)) == n, f"s{i} never queued")
                doomed.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                lost = [f.result(timeout=3) for f in theirs]  # its clients see the connection close at once
                until(lambda: doomed_entries() == 0, "the dead replica's entries stayed", 15)
                gone_after = time.monotonic() - killed_at
                print(f"a dead replica's queued entries were dropped {gone_after:.2f} s after its SIGKILL")
                assert store.zcard(queue_key(fleet)) == 3  # the survivor's, still waiting
            served = [f.result(timeout=40) for f in mine]  # ((response, took), finished at)
        # its clients see their connection close, or (Envoy: it outlives its picker by a moment) a 503 that says retry
        assert all(isinstance(err, httpx.TransportError) or (
            err.status_code == 503 and is_openai_error(err) and "retry-after" in err.headers) for err, _ in lost), lost
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for (r, _), _ in served), served
        # released in queue order: the engine's one batch slot and its one waiting place take s0 and s1 together,
        # s2 only once one of them is done. Their connections reach the engine in any order, and on a busy machine
        # s1's can arrive after s2's (a full run saw s0, s2, s1), so only "s2 is not first" is the queue's doing.
        finished_order = sorted(range(3), key=lambda i: served[i][1])
        assert finished_order[0] != 2, finished_order
        # heartbeat TTL (3 s) plus at most one reconcile interval (2 s), with room for a busy machine
        assert gone_after < 3 + 2 + 3
        assert store.zcard(queue_key(fleet)) == 0
    finally:
        if survivor is not None:
            stop_process(survivor)
        stop_process(doomed)


# ---- drill 3b -----------------------------------------------------------------------------------------------
def test_a_gateway_replica_killed_while_requests_released_to_it_are_leased(engines, model, redis_server) -> None:
    narrow, _ = engines
    fleet = "drill-leases"
    args = ("--engine", narrow, "--redis-url", redis_server.url, "--fleet", fleet, "--saturation-queue", "1")
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    doomed, doomed_url = start_gateway(*args)
    [doomed_id] = [k.rsplit(":", 1)[1] for k in store.keys(key_prefix(fleet) + "gateway:*") if not k.endswith("live")]
    survivor = None

    def doomed_keys() -> tuple[int, int]:
        """The dead replica's (entries, leases) in Redis."""
        entries = store.hgetall(queue_entries_key(fleet)).values()
        leases = store.hgetall(queue_leases_key(fleet)).values()
        return (sum(v.startswith(f"{doomed_id}|") for v in entries), sum(v.startswith(f"{doomed_id}|") for v in leases))
    try:
        survivor, survivor_url = start_gateway(*args)
        wait_until_routable(doomed_url)
        wait_until_routable(survivor_url)
        with ThreadPoolExecutor(8) as pool:
            with saturated(narrow, model, (doomed_url, survivor_url), holders=5):
                theirs, mine = [], []
                for i, (gateway, group) in enumerate([(doomed_url, theirs)] * 3 + [(survivor_url, mine)] * 3):
                    group.append(pool.submit(finished, complete, gateway, model, f"r{i}", 8, 60))
                    until(lambda n=i + 1: store.zcard(queue_key(fleet)) == n, f"request {i} never queued")
                # frozen just after a heartbeat: the survivor has about three seconds to release its entries to it
                until(lambda: store.pttl(heartbeat_key(fleet, doomed_id)) > 2500, "no heartbeat")
                doomed.send_signal(signal.SIGSTOP)
            # the engine has room again: the survivor releases the frozen replica's entries (first in the queue),
            # leased to it, then its own
            until(lambda: doomed_keys()[0] == 0, "the frozen replica's entries were never released", 20)
            leased = doomed_keys()[1]
            doomed.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            lost = [f.result(timeout=20) for f in theirs]  # ((response or error, took), finished at)
            until(lambda: doomed_keys() == (0, 0), "the dead replica's leases stayed", 20)
            gone_after = time.monotonic() - killed_at
            served = [f.result(timeout=60) for f in mine]
        seen = [getattr(err, "status_code", type(err).__name__) for (err, _), _ in lost]
        print(f"{leased} entries leased to the frozen replica when it was killed; its clients saw {seen} "
              f"{max(at for _, at in lost) - killed_at:.2f} s after; its keys were gone {gone_after:.2f} s after")
        assert leased >= 1  # the drill's point: released to it, not yet acknowledged, when it died
        # its clients see their connection close, or (Envoy outlives its picker by a moment) a 503 that says retry
        assert all(isinstance(err, httpx.TransportError) or (
            err.status_code == 503 and is_openai_error(err) and "retry-after" in err.headers)
            for (err, _), _ in lost), lost
        assert all(0 <= at - killed_at < 10 for _, at in lost)  # promptly once it died, not at their deadline
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for (r, _), _ in served), served
        assert gone_after < 3 + 2 + 5  # heartbeat TTL plus one reconcile interval, with room for a busy machine
        assert store.zcard(queue_key(fleet)) == 0 and not store.exists(heartbeat_key(fleet, doomed_id))
    finally:
        if survivor is not None:
            stop_process(survivor)
        doomed.kill()  # frozen or dead either way
        doomed.wait()


# ---- drill 4 ------------------------------------------------------------------------------------------------
def test_an_engine_that_stops_answering_without_closing_connections(engines, model, tiny_model_dir) -> None:
    _, survivor = engines
    [(hung, hung_url)] = start_engine_servers(tiny_model_dir, LONG)
    proxy = BlackholeProxy("127.0.0.1", int(hung_url.rsplit(":", 1)[1])).start()
    gateway, url = start_gateway("--engine", proxy.url, "--engine", survivor, "--routing", "round-robin",
                                 "--engine-unreachable-after", "3")
    bound = 10.0  # "within a few seconds", with room for a busy machine: each client gives up a little later
    try:
        wait_until_routable(url, 2)
        turns = RoundRobinTurns(url, model, (proxy.url, survivor))
        with ThreadPoolExecutor(2) as pool:
            turns.turn_to(proxy.url)
            first, arrivals = threading.Event(), []
            in_flight = pool.submit(stream, url, model, "in flight", first, bound + 2, 1000, arrivals)
            assert first.wait(30), "the stream never started"  # mid-stream: before it, the gateway may still retry
            turns.sent()
            proxy.blackhole()
            hung_at = time.monotonic()
            turns.turn_to(proxy.url)  # round-robin ignores stale metrics: the next request goes to the hung engine
            sent_after = pool.submit(finished, complete, url, model, "sent after", 4, bound + 2)
            # the rest of a 1000-token answer, however slow the machine: the client's own read timeout (bound + 2 s
            # between two chunks) is what ends a stream that hangs
            engine, ending, ended = in_flight.result(timeout=600)
            (answer, _), answered_at = sent_after.result(timeout=60)
        answered_in = answered_at - hung_at
        healthy = httpx.get(f"{url}/ready").json()["healthy"]
        gap = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > hung_at)
        print(f"blackholed: the stream in flight ended ({ending}) after {ended - hung_at:.1f} s, its longest gap "
              f"{gap:.1f} s; the request sent after was answered {getattr(answer, 'status_code', answer)!r} after "
              f"{answered_in:.1f} s; engines healthy: {healthy}")
        # continued on the survivor once the hung engine's /metrics went silent: no hang, nothing lost
        assert engine == proxy.url and ending == "finished" and gap < bound, (ending, gap)
        assert isinstance(answer, httpx.Response) and (answer.status_code == 200 or is_openai_error(answer)), answer
        assert answered_in < bound
        until(lambda: httpx.get(f"{url}/ready").json()["healthy"] == 1, "the hung engine still looks healthy", 2)
        later = [complete(url, model, f"later {i}", 4, timeout=bound) for i in range(4)]
        assert [(r.status_code, r.headers["x-kvfleet-engine"]) if isinstance(r, httpx.Response) else r
                for r, _ in later] == [(200, survivor)] * 4
    finally:
        gateway.kill()  # a graceful stop would wait for the hung upstream requests
        gateway.wait()
        proxy.close()
        hung.kill()
        hung.wait()
