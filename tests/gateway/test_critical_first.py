"""Critical requests are not held at the gateway while an engine can run them first (--critical-first, issue 17).

Engines run critical requests before the others and preempt for them, so a critical request routes past a saturated
fleet while some engine has fewer than --saturation-queue of this replica's critical requests that have not started
there. The decision is pure (routing.critical_room, admission.admit, routing.pick); end to end: one real engine that
runs one sequence at a time, held saturated by long requests sent to it directly, real gateway processes (the Python
proxy and Envoy) on one real Redis, and clients over HTTP. The count behind the rule must return to 0 however a
request ends, or critical requests would queue forever: /ready's `critical_pending` shows it.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvfleet.fleet.load import EngineLoad
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.admission import Action, admit
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys
from kvfleet.gateway.routing.pick import (
    LANE_HOLD_S,
    EndpointSnapshot,
    RoutingContext,
    SaturationPolicy,
    critical_lane,
    critical_room,
    pick,
)
from kvfleet.gateway.routing.router import Router
from kvfleet.gateway.routing.strategies import strategy_named
from tests.conftest import one_sequence_engine_fixtures, start_engine_server, start_gateway, stop_process
from tests.support.clients import LeavingClient, send
from tests.support.engines import waiting
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

POLICY = SaturationPolicy(max_queue=2)


def snapshot(url: str, waiting_: int = 5, critical: int = 0, running: int = 1, age_s: float = 0.01,
             healthy: bool = True, critical_tokens: int = 0, rate: float | None = None, pending: int = 0,
             sent_tokens: int = 0) -> EndpointSnapshot:
    return EndpointSnapshot(url, healthy, kv_cache_usage=0.5, num_waiting=waiting_, num_running=running,
                            metrics_age_s=age_s, max_num_seqs=1, critical_pending=critical,
                            critical_pending_tokens=critical_tokens, prefill_rate=rate,
                            prefill_tokens_pending=pending, in_flight_tokens=sent_tokens)


# ---- the decision, pure -------------------------------------------------------------------------------------------
def test_an_engine_has_room_for_a_critical_request_below_the_saturation_queue_of_critical_ones() -> None:
    fleet = [snapshot("a", critical=2), snapshot("b", critical=1), snapshot("c", critical=0, healthy=False),
             snapshot("d", critical=0, age_s=1.0)]  # d: metrics stale, treated as today (no room)
    assert [e.url for e in critical_room(fleet, POLICY)] == ["b"]
    assert critical_room([snapshot("a", critical=2)], POLICY) == []


def test_a_critical_request_routes_past_saturation_only_while_an_engine_has_room() -> None:
    queue_caps = 100
    assert admit(Priority.CRITICAL, False, 3, 0, queue_caps, critical_has_room=True).action is Action.ROUTE
    assert admit(Priority.CRITICAL, False, 3, 0, queue_caps, critical_has_room=False).action is Action.QUEUE
    # the other classes are unchanged by it
    assert admit(Priority.STANDARD, False, 3, 0, queue_caps, critical_has_room=True).action is Action.QUEUE
    assert admit(Priority.SHEDDABLE, False, 3, 0, queue_caps, critical_has_room=True).action is Action.SHED


@pytest.mark.parametrize("routing", ["kvfleet", "least-request", "estimated-ttft", "prefix-affinity"])
def test_it_goes_to_the_engine_with_the_fewest_critical_pending_then_the_least_loaded(routing: str) -> None:
    strategy = strategy_named(routing, policy=POLICY)
    rng = random.Random(1)
    fleet = [snapshot("a", critical=1, waiting_=3), snapshot("b", critical=0, waiting_=9),
             snapshot("c", critical=0, waiting_=4), snapshot("d", critical=2, waiting_=2)]
    request = RoutingContext(must=True)
    assert pick(strategy, fleet, request, rng, critical=POLICY).url == "c"
    assert pick(strategy, fleet, RoutingContext(must=True, exclude=frozenset({"c"})), rng, critical=POLICY).url == "b"
    full = [snapshot("a", critical=2, waiting_=3), snapshot("b", critical=2, waiting_=9)]
    assert pick(strategy, full, RoutingContext(), rng, critical=POLICY) is None  # it queues
    assert pick(strategy, fleet, RoutingContext(), rng) is None  # not critical, or --no-critical-first
    # an engine is available, but a critical request would wait there behind another: the saturated engine runs it
    # first, at once (the strategy decides only for the other classes)
    idle = [snapshot("a", waiting_=0, running=0, critical=1), snapshot("b", critical=0, waiting_=9)]
    assert pick(strategy, idle, RoutingContext(), random.Random(2)).url == "a"
    assert pick(strategy, idle, RoutingContext(), random.Random(2), critical=POLICY).url == "b"


@pytest.mark.parametrize("routing", ["kvfleet", "round-robin"])
def test_it_goes_where_it_starts_soonest_counting_the_critical_prompt_tokens_ahead_of_it(routing: str) -> None:
    """One long critical prompt ahead takes longer than two short ones; a faster engine clears its share sooner;
    the prompt's own tokens cached on an engine start it sooner there."""
    strategy, rng = strategy_named(routing, policy=POLICY), random.Random(3)
    fleet = [snapshot("a", critical=1, critical_tokens=900, rate=500.0),
             snapshot("b", critical=1, critical_tokens=300, rate=500.0)]  # one below the queue limit each
    assert pick(strategy, fleet, RoutingContext(num_tokens=100), rng, critical=POLICY).url == "b"
    fast = [snapshot("a", critical=1, critical_tokens=900, rate=2000.0),
            snapshot("b", critical=1, critical_tokens=300, rate=500.0)]
    assert pick(strategy, fast, RoutingContext(num_tokens=100), rng, critical=POLICY).url == "a"  # 0.5 s vs 0.8 s
    # an engine that has not measured its rate is taken to be as fast as the fleet's median (b's), not 1 token/s
    unmeasured = [snapshot("a", critical=1, critical_tokens=300), snapshot("b", critical=1, critical_tokens=900,
                                                                          rate=500.0)]
    assert pick(strategy, unmeasured, RoutingContext(num_tokens=100), rng, critical=POLICY).url == "a"
    cached = RoutingContext(prefix_matches={"a": 1.0}, num_tokens=800)  # a: 300 tokens ahead, 0 own; b: 0 + 800
    assert pick(strategy, [snapshot("a", critical=1, critical_tokens=300, rate=500.0),
                           snapshot("b", critical=0, rate=500.0)], cached, rng, critical=POLICY).url == "a"


def test_it_goes_where_no_lower_class_prompt_is_prefilling_before_an_engine_with_a_short_critical_one() -> None:
    """A critical prompt waits for the lower-class prefill in progress where it lands: 600 tokens of standard
    prompts pending on a (reported, or sent by this gateway since the scrape) is longer than one 100-token critical
    prompt on b; what b reports pending is that critical prompt, not counted twice."""
    strategy, rng = strategy_named("kvfleet", policy=POLICY), random.Random(4)
    b = snapshot("b", critical=1, critical_tokens=100, pending=100, rate=500.0)
    for a in (snapshot("a", pending=600, rate=500.0), snapshot("a", sent_tokens=600, rate=500.0)):
        assert pick(strategy, [a, b], RoutingContext(num_tokens=50), rng, critical=POLICY).url == "b"
    idle = snapshot("a", pending=0, rate=500.0)
    assert pick(strategy, [idle, b], RoutingContext(num_tokens=50), rng, critical=POLICY).url == "a"


def test_the_critical_lane_is_the_first_fresh_engine_by_url_once_there_are_two() -> None:
    fleet = [snapshot("http://c"), snapshot("http://b"), snapshot("http://a", healthy=False),
             snapshot("http://0", age_s=1.0)]  # unhealthy and stale engines are never the lane
    assert critical_lane(fleet, POLICY) == {"http://b"}
    assert critical_lane(fleet[:1], POLICY) == frozenset()  # one engine: it serves every class


def test_with_a_critical_lane_other_classes_keep_off_it_for_a_minute_after_a_critical_request() -> None:
    pool = EndpointPool()
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    pool.set_urls(urls)
    for i, url in enumerate(urls):  # the lane (the first URL) is the least loaded: least-request would pick it
        pool.record_scrape(url, EngineLoad(kv_cache_usage=0.1, num_running=i, num_waiting=0))
    now = [1000.0]
    router = Router(GatewayConfig(routing="least-request", critical_lane=True), pool, PrefixRouting(),
                    GatewayMetrics(), random.Random(5), clock=lambda: now[0])
    keys = PromptKeys([])
    assert router.choose(keys) == urls[0]  # no critical request yet: no lane
    assert router.choose(keys, critical=True) == urls[0]
    assert router.reserved(pool.snapshots()) == {urls[0]}
    assert router.choose(keys) == urls[1]
    assert router.rank(keys, must=True, fallbacks=2) == urls[1:]  # a retry's fallbacks keep off it too
    assert router.choose(keys, critical=True) == urls[0]  # critical requests still go there
    now[0] += LANE_HOLD_S + 1
    assert router.reserved(pool.snapshots()) == frozenset()
    assert router.choose(keys) == urls[0]
    off = Router(GatewayConfig(routing="least-request"), pool, PrefixRouting(), GatewayMetrics(), random.Random(5))
    off.choose(keys, critical=True)
    assert off.choose(keys) == urls[0]  # without --critical-lane, the default


def test_the_count_is_taken_back_once_however_often_the_end_is_reported() -> None:
    pool = EndpointPool()
    pool.set_urls(["http://a"])
    pool.record_scrape("http://a", EngineLoad(kv_cache_usage=0.1, num_waiting=0, num_running=0))
    first, second = pool.critical_sent("http://a", 120), pool.critical_sent("http://a", 30)
    assert (pool.snapshots()[0].critical_pending, pool.snapshots()[0].critical_pending_tokens) == (2, 150)
    first()
    first()  # headers came, then the stream ended: one request, one decrement
    assert (pool.snapshots()[0].critical_pending, pool.snapshots()[0].critical_pending_tokens) == (1, 30)
    pool.set_urls([])  # the engine left the pool, then came back: the old request's end leaves the new count alone
    pool.set_urls(["http://a"])
    third = pool.critical_sent("http://a")
    second()
    assert pool.endpoints["http://a"].critical_pending == 1
    third()
    assert (pool.endpoints["http://a"].critical_pending, pool.endpoints["http://a"].critical_tokens) == (0, 0)
    pool.critical_sent("http://gone")()  # an engine not in the pool: nothing counted, nothing to take back


# ---- end to end ---------------------------------------------------------------------------------------------------
engine, model = one_sequence_engine_fixtures()
DATA_PLANES = ["python", "envoy"]


@contextlib.contextmanager
def gateway(engine_url: str, redis_url: str, fleet: str, *extra: str) -> Iterator[str]:
    proc, url = start_gateway("--engine", engine_url, "--redis-url", redis_url, "--fleet", fleet,
                              "--saturation-queue", "1", *extra)
    try:
        wait_until_routable(url)
        yield url
    finally:
        stop_process(proc)


def hold(url: str, model_: str, stop: threading.Event, priority: int = 0) -> None:
    """A long stream sent to the engine directly (the gateway does not count it), dropped when told to."""
    # as long as the one-sequence engine's context allows: on a quiet machine 700 tokens ended within the 2 s the
    # impatient client of the test below waits, and its request ran
    body = {"model": model_, "prompt": "busy", "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "priority": priority}
    with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/completions", json=body,
                                                             timeout=120) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return


@contextlib.contextmanager
def held(engine_url: str, model_: str, count: int, gateway_url: str, priority: int = 0) -> Iterator[None]:
    """`count` long requests at the engine: with one batch slot, one runs and the rest wait; the block runs once the
    gateway counts the engine saturated."""
    stop = threading.Event()
    holders = [threading.Thread(target=hold, args=(engine_url, model_, stop, priority)) for _ in range(count)]
    for t in holders:
        t.start()
        time.sleep(0.05)
    try:
        until(lambda: waiting(engine_url) == count - 1, f"the engine never had {count - 1} waiting")
        until(lambda: ready(gateway_url)["available"] == 0, "the gateway never saw the engine saturated")
        yield
    finally:
        stop.set()
        for t in holders:
            t.join()


def ready(url: str) -> dict:
    return httpx.get(f"{url}/ready").json()


def running(engine_url: str) -> int:
    for line in httpx.get(f"{engine_url}/metrics").text.splitlines():
        if line.startswith("kvfleet_num_requests_running "):
            return int(float(line.split()[1]))
    raise AssertionError("no kvfleet_num_requests_running")


def queue_waits(url: str, priority: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'kvfleet_gateway_queue_wait_seconds_count{{priority="{priority}"}}'):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("data_plane", DATA_PLANES)
def test_a_critical_request_is_answered_while_the_fleet_is_saturated_and_others_wait(
        engine, model, redis_server_module, data_plane: str) -> None:
    results: dict = {}
    with gateway(engine, redis_server_module.url, f"cf-{data_plane}", "--data-plane", data_plane) as url:
        with held(engine, model, 2, url):
            standard = threading.Thread(target=send, args=(url, model, "standard", results, "standard"))
            standard.start()
            until(lambda: ready(url)["queued"] == 1, "the standard request never queued behind the saturated fleet")
            started = time.monotonic()
            send(url, model, "critical", results, "critical", timeout=60)
            took = time.monotonic() - started
            response = results["critical"][0]
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
            assert ready(url)["queued"] == 1  # the standard one still waits; the critical one went past it
            assert queue_waits(url, "critical") == 0  # it never waited in the gateway's queue
        standard.join()
        assert results["standard"][0].status_code == 200
        assert queue_waits(url, "standard") == 1
        until(lambda: ready(url)["critical_pending"] == 0, "the answered critical request is still counted", 5)
    assert took < 30


def test_with_no_critical_first_a_critical_request_queues_as_the_others_do(engine, model,
                                                                           redis_server_module) -> None:
    results: dict = {}
    with gateway(engine, redis_server_module.url, "cf-off", "--data-plane", "python", "--no-critical-first") as url:
        with held(engine, model, 2, url):
            critical = threading.Thread(target=send, args=(url, model, "critical", results, "critical"))
            critical.start()
            until(lambda: ready(url)["queued"] == 1, "the critical request was not queued with --no-critical-first")
            assert "critical" not in results
        critical.join()
        assert results["critical"][0].status_code == 200
        assert queue_waits(url, "critical") == 1


@pytest.mark.parametrize("data_plane", DATA_PLANES)
def test_a_critical_request_whose_client_leaves_before_it_starts_is_no_longer_counted(
        engine, model, redis_server_module, data_plane: str) -> None:
    """A critical request runs at the engine behind other critical ones (no preemption among equals): the gateway's
    request waits there unstarted, counted, until its client gives up (once the gateway counts it, while the engine
    is still busy with the long ones ahead of it)."""
    with gateway(engine, redis_server_module.url, f"cf-gone-{data_plane}", "--data-plane", data_plane) as url:
        with held(engine, model, 3, url, priority=-2):
            client = LeavingClient(url, {"model": model, "prompt": "impatient", "max_tokens": 8},
                                   **{"x-kvfleet-priority": "critical"})
            until(lambda: ready(url)["critical_pending"] == 1, "the request waiting at the engine was not counted")
            assert client.leave() == b""  # nothing was answered: it never started
            until(lambda: ready(url)["critical_pending"] == 0, "a critical request whose client left is still "
                                                               "counted", 5)


@pytest.mark.parametrize("data_plane", DATA_PLANES)
def test_a_critical_request_on_an_engine_that_dies_is_no_longer_counted(tiny_model_dir, model, redis_server_module,
                                                                        data_plane: str) -> None:
    proc, doomed = start_engine_server(tiny_model_dir, "--max-num-seqs", "1", "--max-model-len", "1024",
                                       "--kv-cache-memory", "32MiB")
    results: dict = {}
    try:
        with gateway(doomed, redis_server_module.url, f"cf-dead-{data_plane}", "--data-plane", data_plane) as url:
            stop = threading.Event()
            holder = threading.Thread(target=hold, args=(doomed, model, stop, -2))
            holder.start()
            until(lambda: running(doomed) == 1, "the engine never ran the held request")
            client = threading.Thread(target=send, args=(url, model, "critical", results, "orphan"))
            client.start()
            until(lambda: ready(url)["critical_pending"] == 1, "the request waiting at the engine was not counted")
            proc.kill()
            client.join()
            stop.set()
            holder.join()
            assert results["orphan"][0].status_code in (502, 503)
            until(lambda: ready(url)["critical_pending"] == 0, "a critical request its engine never answered is "
                                                               "still counted", 5)
    finally:
        with contextlib.suppress(Exception):
            stop_process(proc)


def routed(url: str) -> dict[str, float]:
    """The gateway's kvfleet_gateway_routed count per engine URL."""
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("kvfleet_gateway_routed_total{"):
            counts[line.split('endpoint="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def test_with_the_critical_lane_standard_requests_keep_off_the_lane_after_a_critical_one(
        batch_engine, redis_server_module) -> None:
    """One real engine behind two URLs, as two engines to the gateway: once a critical request came, /ready names the
    lane (the first URL) and every standard request goes to the other, where least-request would split them."""
    port = batch_engine.rsplit(":", 1)[1]
    lane, other = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
    model_ = httpx.get(f"{batch_engine}/v1/models", timeout=5).json()["data"][0]["id"]
    with gateway(lane, redis_server_module.url, "lane", "--engine", other, "--critical-lane", "--routing",
                 "least-request", "--saturation-queue", "5") as url:
        until(lambda: ready(url)["healthy"] == 2, "both URLs healthy")
        assert ready(url)["critical_lane"] == []  # no critical request yet
        body = {"model": model_, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                          headers={"x-kvfleet-priority": "critical"}).status_code == 200
        assert ready(url)["critical_lane"] == [lane]
        before = routed(url)
        for _ in range(8):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        after = routed(url)
        assert after.get(other, 0) - before.get(other, 0) == 8 and after.get(lane, 0) == before.get(lane, 0)
