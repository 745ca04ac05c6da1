"""The gateway's routing decision, as pure functions over endpoint snapshots."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, SaturationPolicy, pick
from kvfleet.gateway.routing.strategies import strategy_named


def ep(url: str, kv: float = 0.1, waiting: int = 0, running: int = 0, age: float = 0.05, healthy: bool = True,
       in_flight: int = 0) -> EndpointSnapshot:
    return EndpointSnapshot(url, healthy, kv, waiting, running, age, in_flight)


def pick_by_score(endpoints: list[EndpointSnapshot], prefix_matches: dict[str, float],
                  rng: random.Random) -> EndpointSnapshot | None:
    return pick(strategy_named("kvfleet"), endpoints, RoutingContext(prefix_matches), rng)


def pick_least_request(endpoints: list[EndpointSnapshot], rng: random.Random) -> EndpointSnapshot | None:
    return pick(strategy_named("least-request"), endpoints, RoutingContext(), rng)


def pick_round_robin(endpoints: list[EndpointSnapshot], turn: int) -> EndpointSnapshot | None:
    return pick(strategy_named("round-robin"), endpoints, RoutingContext(turn=turn), random.Random(0))


def test_most_kv_headroom_wins_when_queues_are_equal() -> None:
    chosen = pick_by_score([ep("a", kv=0.6), ep("b", kv=0.1), ep("c", kv=0.4)], {}, random.Random(0))
    assert chosen.url == "b"


def test_shorter_queue_wins_when_kv_is_equal() -> None:
    chosen = pick_by_score([ep("a", waiting=3), ep("b", waiting=0, in_flight=1), ep("c", waiting=2)], {},
                           random.Random(0))
    assert chosen.url == "b"


def test_prefix_affinity_outweighs_a_small_load_difference() -> None:
    endpoints = [ep("a", kv=0.3, waiting=1), ep("b", kv=0.1)]
    assert pick_by_score(endpoints, {"a": 0.9}, random.Random(0)).url == "a"
    assert pick_by_score(endpoints, {}, random.Random(0)).url == "b"


def test_saturated_unhealthy_and_stale_endpoints_are_never_chosen() -> None:
    endpoints = [ep("full-kv", kv=0.85), ep("long-queue", waiting=4, in_flight=1), ep("stale", age=0.5),
                 ep("down", healthy=False), ep("ok", kv=0.7, waiting=4)]
    for seed in range(20):
        assert pick_by_score(endpoints, {"full-kv": 1.0, "stale": 1.0}, random.Random(seed)).url == "ok"
        assert pick_least_request(endpoints, random.Random(seed)).url == "ok"


def test_everything_saturated_means_queue_the_request() -> None:
    assert pick_by_score([ep("a", kv=0.9), ep("b", waiting=5)], {}, random.Random(0)) is None
    assert pick_least_request([ep("a", age=1.0)], random.Random(0)) is None


def test_equal_endpoints_share_the_load_instead_of_herding() -> None:
    endpoints = [ep(u) for u in "abcd"]
    picks = Counter(pick_by_score(endpoints, {}, random.Random(seed)).url for seed in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 50


def test_round_robin_rotates_over_healthy_endpoints_blind_to_load() -> None:
    endpoints = [ep("a", kv=0.99), ep("b", healthy=False), ep("c")]
    assert [pick_round_robin(endpoints, i).url for i in range(4)] == ["a", "c", "a", "c"]
    assert pick_round_robin([ep("x", healthy=False)], 0) is None


@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 10), st.floats(0, 0.5), st.booleans()), min_size=1,
                max_size=8), st.integers(0, 1000))
def test_choice_is_always_available_and_never_clearly_worse_than_another(rows, seed) -> None:
    endpoints = [ep(f"e{i}", kv=kv, waiting=w, age=age, healthy=h) for i, (kv, w, age, h) in enumerate(rows)]
    chosen = pick_by_score(endpoints, {}, random.Random(seed))
    policy = SaturationPolicy()
    ok = [e for e in endpoints if e.healthy and not policy.is_saturated(e)]
    assert (chosen is None) == (not ok)
    if chosen is not None:
        assert chosen in ok
        better = [e for e in ok if e.kv_cache_usage < chosen.kv_cache_usage - 0.05
                  and e.queue_depth < chosen.queue_depth]
        assert not better, "an endpoint with both more KV room and a shorter queue was passed over"


def test_an_engine_slow_to_render_its_metrics_is_scraped_less_often_and_judged_stale_by_its_own_pace() -> None:
    from kvfleet.gateway.engines.scraper import scrape_interval_s

    assert scrape_interval_s(0.075, None) == 0.075  # not measured yet
    assert scrape_interval_s(0.075, 0.002, 600) == 0.075  # a kvfleet engine's filtered /metrics: the base pace
    assert scrape_interval_s(0.075, 0.05, 600) == 0.075  # filtered but slow: a busy engine, still read often
    assert abs(scrape_interval_s(0.075, 0.02, 53_000) - 0.4) < 1e-9  # vLLM's 53 KB: 20x what it takes
    assert scrape_interval_s(0.075, 0.5, 53_000) == 1.0  # at least once a second
    policy = SaturationPolicy()
    fast = EndpointSnapshot("a", True, 0.1, 0, 0, 0.3, scrape_interval_s=0.075)
    slow = EndpointSnapshot("b", True, 0.1, 0, 0, 0.3, scrape_interval_s=0.4)
    assert policy.is_stale(fast) and policy.is_saturated(fast)  # 0.3 s old at 13 scrapes/s: something is wrong
    assert not policy.is_stale(slow) and not policy.is_saturated(slow)  # less than one of its intervals
    assert policy.is_stale(EndpointSnapshot("b", True, 0.1, 0, 0, 1.1, scrape_interval_s=0.4))  # 2.5 missed


def test_round_robin_replicas_started_together_do_not_rotate_in_lockstep() -> None:
    """Each replica's rotation starts at a random engine (Envoy's round robin does the same per worker): eight
    replicas started at once spread their first requests over the four engines instead of all sending to the first."""
    from kvfleet.fleet.load import EngineLoad
    from kvfleet.gateway.config import GatewayConfig
    from kvfleet.gateway.engines.pool import EndpointPool
    from kvfleet.gateway.metrics import GatewayMetrics
    from kvfleet.gateway.prefix.worth import PrefixRouting, PromptKeys
    from kvfleet.gateway.routing.router import Router

    urls = [f"http://e{i}" for i in range(4)]
    firsts = []
    for seed in range(8):
        pool = EndpointPool()
        pool.set_urls(urls)
        for url in urls:
            pool.record_scrape(url, EngineLoad(kv_cache_usage=0.1, num_waiting=0, num_running=0))
        router = Router(GatewayConfig(routing="round-robin"), pool, PrefixRouting(), GatewayMetrics(),
                        rng=random.Random(seed))
        picks = [router.choose(PromptKeys([])) for _ in range(8)]
        assert Counter(picks) == {url: 2 for url in urls}  # still a rotation: each engine in turn
        firsts.append(picks[0])
    assert len(set(firsts)) >= 3, firsts
