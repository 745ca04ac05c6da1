"""Engine failures through Envoy (`--data-plane envoy`, issue 22 item 3): the picker names the chosen engine and
a fallback (the Inference Extension's destination list); Envoy retries once, on the fallback, exactly what the
Python proxy retries (gateway/engines/failure_class.py), and nothing the request caused. These are non-streamed
requests, which Envoy carries straight to their engine whether migration is on or off (the streams it hands to the
gateway's app are retried there, on the same fallback: tests/gateway/test_stream_migration.py). A client that hangs
up frees the engine. The failing engines are stand-ins (tests/support/stand_in_engine.py); the gateway and Envoy are
real.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvfleet.fleet.load import EngineLoad
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.engines.failure_class import AnswerClass, classify_attempt, engine_health
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.envoy.bootstrap import DESTINATION_HEADER
from kvfleet.gateway.envoy.eds import FALLBACKS, EndpointsFile, endpoints_document, envoy_address, outside_subset
from kvfleet.gateway.envoy.messages import SUBSET_KEY, SUBSET_NAMESPACE, route_to, subset_hint
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys
from kvfleet.gateway.routing.router import Router
from tests.conftest import start_gateway, stop_process
from tests.support.engines import running
from tests.support.gateways import counter, wait_until_routable
from tests.support.polling import until
from tests.support.stand_in_engine import StandInEngine, complete, error_body


@pytest.fixture
def fleet():
    """Two stand-in engines behind Envoy; round-robin makes each the first choice in turn, two faults eject."""
    engines = [StandInEngine(), StandInEngine()]
    gateway, url = start_gateway(*(a for e in engines for a in ("--engine", e.url)), "--routing", "round-robin",
                                 "--eject-after-failures", "2", "--data-plane", "envoy", timeout=90.0)
    wait_until_routable(url, 2)
    yield url, engines
    stop_process(gateway)
    for engine in engines:
        engine.close()


def ejections(url: str, engine: str) -> float:
    return counter(httpx.get(f"{url}/metrics").text, f'kvfleet_gateway_ejections_total{{endpoint="{engine}"}}')


def until_counted(url: str, answers: int) -> None:
    """Until Envoy's access log of `answers` requests has reached the picker: each attempt's entry (the outcome that
    ejects) comes before its request's end, which the picker counts; after that, nothing more is on its way."""
    until(lambda: counter(httpx.get(f"{url}/metrics").text, "kvfleet_gateway_requests_total") >= answers,
          f"the picker never counted {answers} answers from Envoy's access log", 10)


def refuse_new_connections(engine: StandInEngine) -> None:
    """The engine stops listening; the gateway's scraper keeps its open connection, so the engine still looks
    healthy, as one that died since its last scrape does: only the attempt to reach it can tell."""
    engine.server.shutdown()
    engine.server.socket.close()


def test_an_engine_that_refuses_connections_is_retried_on_the_other_and_ejected(fleet) -> None:
    url, (dead, healthy) = fleet
    refuse_new_connections(dead)
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{dead.url}/v1/completions", json={"prompt": "x"}, timeout=5)
    for i in range(6):
        r = complete(url, f"q{i}")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvfleet-engine"] == healthy.url
    assert len(healthy.prompts) == 6 and not dead.prompts
    until(lambda: ejections(url, dead.url) == 1, "the engine that refused connections was never ejected", 10)


def test_an_engine_fault_is_retried_once_on_the_other_engine(fleet) -> None:
    url, (broken, healthy) = fleet
    broken.broken = True
    for i in range(6):
        r = complete(url, f"q{i}")
        assert r.status_code == 200 and r.headers["x-kvfleet-engine"] == healthy.url
    # outcomes reach the picker in Envoy's access log (flushed every 0.25 s), so a fault or two more may land first
    until(lambda: ejections(url, broken.url) == 1, "the faulty engine was never ejected", 10)
    tried = len(broken.prompts)
    assert 2 <= tried <= 6
    for i in range(4):
        assert complete(url, f"after{i}").headers["x-kvfleet-engine"] == healthy.url
    assert len(broken.prompts) == tried  # ejected: no longer tried


def test_with_every_engine_faulty_the_request_is_tried_twice_then_answered(fleet) -> None:
    url, engines = fleet
    for engine in engines:
        engine.broken = True
    r = complete(url, "q")
    assert r.status_code == 500 and "engine thread died" in r.json()["error"]["message"]
    assert [len(e.prompts) for e in engines] == [1, 1]  # one retry, on the other engine


def answer_busy(engine: StandInEngine) -> None:
    """From now on the engine answers every completion 429 (full), as a busy engine does."""

    class Busy(engine.server.RequestHandlerClass):
        def do_POST(self) -> None:
            engine.prompts.append(json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"])
            self.answer(429, error_body("the engine is full"))

    engine.server.RequestHandlerClass = Busy


def test_a_busy_engine_is_tried_elsewhere_and_never_ejected(fleet) -> None:
    url, (busy, healthy) = fleet
    answer_busy(busy)
    for i in range(6):
        r = complete(url, f"q{i}")
        assert r.status_code == 200 and r.headers["x-kvfleet-engine"] == healthy.url
    assert len(busy.prompts) == 3  # still the first choice every other time: busy is not broken
    until_counted(url, 6)  # still nothing ejected
    assert ejections(url, busy.url) == 0 and httpx.get(f"{url}/ready").json()["available"] == 2


@pytest.mark.parametrize("prompt,status", [("poison-400", 400), ("poison-500", 500)])
def test_an_answer_the_request_caused_is_returned_as_is_and_never_retried(fleet, prompt: str, status: int) -> None:
    url, engines = fleet
    for _ in range(4):
        r = complete(url, prompt)
        assert r.status_code == status
    assert [e.prompts.count(prompt) for e in engines] == [2, 2]  # each went to one engine, once
    until_counted(url, 4)  # still nothing ejected
    metrics = httpx.get(f"{url}/metrics").text
    assert counter(metrics, "kvfleet_gateway_ejections_total") == 0


def test_a_client_that_hangs_up_frees_the_engine(tiny_server: str) -> None:
    """Envoy resets the engine's request when its client leaves: the engine stops generating at once."""
    gateway, url = start_gateway("--engine", tiny_server, "--data-plane", "envoy", timeout=90.0)
    try:
        wait_until_routable(url)
        model = httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "a", "max_tokens": 240, "ignore_eos": True}
        # streamed: the client reads two chunks and closes
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            next(lines), next(lines)
            assert running(tiny_server) == 1
        assert until(lambda: running(tiny_server) == 0, "the engine kept generating for a client that left", 3) < 2
        # not streamed: the client hangs up while the engine generates (a raw socket, closed the moment the engine
        # runs the request: however fast the engine, the client is gone before the answer)
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            until(lambda: running(tiny_server) == 1, "the request never reached the engine", 5)
        assert until(lambda: running(tiny_server) == 0, "the engine kept generating for a client that left", 3) < 2
    finally:
        stop_process(gateway)


# ---- the picker's side of the protocol, on plain data (no proxy here sends a subset hint) -------------------
def _router(*urls: str) -> Router:
    pool = EndpointPool()
    pool.set_urls(urls)
    for i, url in enumerate(urls):  # engine i has i requests running: least-request ranks them in this order
        pool.record_scrape(url, EngineLoad(kv_cache_usage=0.1, num_running=i, num_waiting=0))
    return Router(GatewayConfig(routing="least-request"), pool, PrefixRouting(), GatewayMetrics())


def destinations(router: Router, subset: frozenset[str] | None = None) -> list[str]:
    """The picker's destination list for a request: its engine, then Envoy's fallback, within the subset hint."""
    pick = router.dispatch(PromptKeys([]), outside_subset(router.pool.urls(), subset), fallbacks=FALLBACKS)
    return [] if pick is None else [pick.url, *pick.fallbacks]


def _with_subset(value) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    request.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_KEY: value})
    return request


def test_the_picker_names_the_best_engine_then_the_next_best_in_header_and_metadata() -> None:
    router = _router("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
    urls = destinations(router)
    assert urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    message = route_to(urls, None, None)
    [header] = [h.header for h in message.request_body.response.header_mutation.set_headers
                if h.header.key == DESTINATION_HEADER]
    assert header.raw_value == b"10.0.0.1:8000,10.0.0.2:8000"
    assert message.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == \
        "10.0.0.1:8000,10.0.0.2:8000"
    assert message.request_body.response.clear_route_cache  # so that Envoy picks the route that retries


def test_engines_are_named_by_address_as_envoy_names_its_hosts() -> None:
    assert envoy_address("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert envoy_address("http://[::1]:8000") == "[::1]:8000"
    assert envoy_address("http://localhost:8000") in ("127.0.0.1:8000", "[::1]:8000")  # resolved: no names
    [assignment] = endpoints_document(["[::1]:8000", "10.0.0.1:8001"])["resources"]
    assert [e["endpoint"]["address"]["socket_address"] for e in assignment["endpoints"][0]["lb_endpoints"]] == [
        {"address": "10.0.0.1", "port_value": 8001}, {"address": "::1", "port_value": 8000}]


@pytest.mark.parametrize("hint,expected", [
    (["10.0.0.3:8000"], ["http://10.0.0.3:8000"]),  # the best engine is outside the subset: not picked
    ("10.0.0.2:8000, 10.0.0.3:8000", ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]),  # one string, commas
    (["10.0.0.3"], ["http://10.0.0.3:8000"]),  # an address without a port: any port
    (["10.9.9.9:8000"], []),  # none of the pool: the picker answers 503
    ([], []),
])
def test_the_picker_picks_only_within_the_proxys_subset_hint(hint, expected) -> None:
    router = _router("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
    subset = subset_hint(_with_subset(hint))
    assert destinations(router, subset) == expected
    assert subset_hint(pb.ProcessingRequest(request_headers=pb.HttpHeaders())) is None  # no hint: the whole pool


@pytest.mark.parametrize("status,flags,headers,expected", [
    (200, (), {}, AnswerClass.OK),
    (0, ("UF", "URX"), {}, AnswerClass.FAULT),  # connection refused
    (503, ("UF",), {}, AnswerClass.FAULT),  # Envoy's own 503 for it
    (200, ("UR",), {}, AnswerClass.FAULT),  # reset midway through a stream
    (504, ("UT",), {}, AnswerClass.FAULT),
    (500, (), {"x-kvfleet-fault": "engine"}, AnswerClass.FAULT),
    (500, (), {}, AnswerClass.REQUEST),
    (404, (), {"x-kvfleet-fault": "engine"}, AnswerClass.REQUEST),
    (429, (), {}, AnswerClass.BUSY),
    (503, (), {}, AnswerClass.BUSY),
    (0, ("DC",), {}, None),  # the client left before any answer
    (200, ("DC",), {}, AnswerClass.OK),  # ... or during a good one
    (0, ("UH",), {}, None),  # Envoy had no engine to try
    (503, ("UO",), {}, None),  # Envoy's own connection cap
])
def test_the_class_of_one_envoy_attempt(status: int, flags: tuple, headers: dict, expected) -> None:
    assert classify_attempt(status, flags, headers) is expected


def test_only_an_engines_own_fault_counts_toward_ejection() -> None:
    assert [engine_health(v) for v in (AnswerClass.OK, AnswerClass.FAULT, AnswerClass.BUSY, AnswerClass.REQUEST,
                                       None)] == [True, False, None, None, None]


def test_envoys_endpoint_file_follows_the_pool_as_discovery_changes_it(tmp_path) -> None:
    """Engines discovered later reach Envoy's cluster, and removed ones leave it, without a restart."""

    async def run() -> list[str]:
        pool = EndpointPool()
        path = tmp_path / "eds" / "engines.json"
        mirror = asyncio.create_task(EndpointsFile(pool, path).run())
        seen = []
        for urls in (["http://10.0.0.1:8000"], ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                     ["http://10.0.0.2:8000"]):
            pool.set_urls(urls)
            for _ in range(100):
                await asyncio.sleep(0.01)
                text = path.read_text()
                if all(envoy_address(u) in text for u in urls) and text.count("port_value") == len(urls):
                    break
            seen.append(path.read_text())
        mirror.cancel()
        return seen

    first, both, last = asyncio.run(run())
    assert "10.0.0.1" in first and "10.0.0.2" not in first
    assert "10.0.0.1" in both and "10.0.0.2" in both
    assert "10.0.0.1" not in last and "10.0.0.2" in last
