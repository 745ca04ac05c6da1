"""What the gateway does with a request on arrival, the queue's order, and prefix affinity: pure decisions."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet.fleet.load import EngineLoad
from kvfleet.fleet.priority import Priority, parse_priority
from kvfleet.gateway.admission import Action, admit
from kvfleet.gateway.config import GatewayConfig, parse_queue_caps
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.prefix.approximate import ApproximatePrefixTable, prompt_text
from kvfleet.gateway.queue.local import LocalQueue
from kvfleet.gateway.queue.order import QueueEntry, queue_score
from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, SaturationPolicy, free_slots, pick
from kvfleet.gateway.routing.strategies import strategy_named

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE
KVFLEET = strategy_named("kvfleet")


def test_requests_route_at_once_while_there_is_room_and_nobody_waits() -> None:
    for p in Priority:
        assert admit(p, True, 0, 0, 10).action is Action.ROUTE


def test_when_others_wait_new_requests_queue_behind_them_even_with_room() -> None:
    assert admit(S, True, 3, 1, 10).action is Action.QUEUE
    assert admit(C, True, 3, 0, 10).action is Action.QUEUE


def test_sheddable_never_waits_behind_others() -> None:
    assert admit(X, True, 3, 0, 10).action is Action.SHED  # a queue means the fleet was saturated just now


def test_sheddable_is_shed_when_the_fleet_is_saturated_others_queue() -> None:
    verdict = admit(X, False, 0, 0, 10)
    assert verdict.action is Action.SHED and verdict.reason == "saturated"
    assert "x-kvfleet-priority" in verdict.message
    assert admit(C, False, 0, 0, 10).action is Action.QUEUE
    assert admit(S, False, 0, 0, 10).action is Action.QUEUE


def test_a_full_class_is_shed_with_the_cap_in_the_message() -> None:
    verdict = admit(S, False, 50, 50, 50)
    assert verdict.action is Action.SHED and verdict.reason == "queue_full" and "50 waiting" in verdict.message
    assert admit(C, False, 50, 0, 50).action is Action.QUEUE  # another class still has room


@pytest.mark.parametrize("value,expected", [(None, S), ("", S), ("critical", C), (" Sheddable ", X)])
def test_priority_header(value: str | None, expected: Priority) -> None:
    assert parse_priority(value) is expected


@pytest.mark.parametrize("bad", ["urgent", "0", "high"])
def test_an_unknown_priority_names_the_valid_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="critical, standard, sheddable"):
        parse_priority(bad)


def test_strict_priority_within_the_aging_window_fcfs_within_a_class() -> None:
    aging = 10_000
    q = LocalQueue()
    arrivals = [("s1", S, 0), ("x1", X, 10), ("c1", C, 20), ("s2", S, 30), ("c2", C, 40)]
    for name, p, t in arrivals:
        q.enqueue(QueueEntry(name, p, queue_score(t, p, aging), 1e12, "gw"), cap=None)
    assert [e.id for e in q.release(10)] == ["c1", "c2", "s1", "s2", "x1"]


def test_a_request_older_than_the_aging_window_overtakes_fresh_higher_classes() -> None:
    aging = 10_000
    old_standard = queue_score(0, S, aging)
    assert old_standard < queue_score(10_001, C, aging)  # waited longer than aging_ms: goes first
    assert old_standard > queue_score(9_999, C, aging)  # within the window: critical first


@given(st.lists(st.tuples(st.sampled_from(list(Priority)), st.integers(0, 10**6)), min_size=1, max_size=60))
def test_nothing_starves_every_entry_is_released_exactly_once(items: list[tuple[Priority, int]]) -> None:
    q = LocalQueue()
    for i, (p, t) in enumerate(items):
        q.enqueue(QueueEntry(str(i), p, queue_score(t, p, 10_000), 1e12, "gw"), cap=None)
    out = []
    while len(q):
        out += [e.id for e in q.release(3)]
    assert sorted(out, key=int) == [str(i) for i in range(len(items))]


def test_local_queue_caps_and_removal() -> None:
    q = LocalQueue()
    assert q.enqueue(QueueEntry("a", S, 1, 1e12, "gw"), cap=1)
    assert not q.enqueue(QueueEntry("b", S, 2, 1e12, "gw"), cap=1)
    assert q.enqueue(QueueEntry("c", C, 3, 1e12, "gw"), cap=1)
    assert q.remove("a") and not q.remove("a")
    assert q.counts()[S] == 0 and q.counts()[C] == 1
    assert [e.id for e in q.release(5)] == ["c"]


def test_prefix_affinity_matches_the_share_of_leading_blocks_sent_to_an_engine() -> None:
    affinity = ApproximatePrefixTable(block_chars=16)
    system = "You are a helpful assistant. " * 4  # 116 chars: 7 full blocks
    first = affinity.block_hashes(system + "What is 2+2?")
    affinity.record(first, "http://a")
    second = affinity.block_hashes(system + "Name a colour, please.")
    match = affinity.matches(second)
    assert set(match) == {"http://a"} and 0.5 < match["http://a"] < 1.0
    assert affinity.matches(affinity.block_hashes("something else entirely, no shared start")) == {}
    affinity.forget("http://a")
    assert affinity.matches(second) == {}


def test_prefix_hashes_are_chained_so_equal_blocks_at_other_positions_do_not_match() -> None:
    affinity = ApproximatePrefixTable(block_chars=4)
    affinity.record(affinity.block_hashes("aaaabbbb"), "http://a")
    assert affinity.matches(affinity.block_hashes("bbbbaaaa")) == {}


def test_prefix_table_is_bounded() -> None:
    affinity = ApproximatePrefixTable(block_chars=4, capacity=10)
    for i in range(100):
        affinity.record(affinity.block_hashes(f"{i:04d}" * 3), "http://a")
    assert len(affinity._owner) == 10


def test_prompt_text_of_chat_and_completion_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]}
    assert prompt_text(chat) == "system\nS\nuser\nhi\n"
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == ""
    assert prompt_text({"messages": "not a list"}) == ""


def ep(url: str, waiting: int = 0, kv: float = 0.1, healthy: bool = True, age: float = 0.05, running: int = 0,
       in_flight: int = 0, capacity: int | None = None) -> EndpointSnapshot:
    return EndpointSnapshot(url, healthy, kv, waiting, running, age, in_flight, capacity)


def test_dispatches_that_fit_in_free_batch_slots_do_not_count_as_queue() -> None:
    assert ep("a", running=2, in_flight=6, capacity=8).queue_depth == 0
    assert ep("a", running=2, in_flight=9, capacity=8).queue_depth == 3
    assert ep("a", running=2, in_flight=6).queue_depth == 6  # capacity unknown (vLLM): every dispatch counts


def test_a_busy_small_engine_scores_below_an_idle_large_one() -> None:
    small = ep("small", running=1, capacity=1)
    large = ep("large", running=0, capacity=8)
    assert pick(KVFLEET, [small, large], RoutingContext(), random.Random(0)).url == "large"


def test_releases_fill_free_batch_slots_and_keep_few_waiting_in_the_engine() -> None:
    assert free_slots([ep("a", running=2, capacity=8)]) == 6 + 1
    assert free_slots([ep("a", running=8, waiting=4, capacity=8)]) == 0  # its own FIFO queue holds enough
    assert free_slots([ep("a", running=8, capacity=8)]) == 1  # one waiting covers the next freed slot
    assert free_slots([ep("a", running=8, capacity=8)], SaturationPolicy(release_queue=0)) == 0
    assert free_slots([ep("a", running=8, capacity=8)], SaturationPolicy(release_queue=3)) == 3


def test_without_a_batch_capacity_free_slots_count_room_below_the_queue_limit() -> None:
    assert free_slots([ep("a", waiting=0), ep("b", waiting=3), ep("c", waiting=9), ep("d", healthy=False)]) == 7
    assert free_slots([ep("a", kv=0.95), ep("b", age=1.0)]) == 0


def test_a_released_request_goes_to_the_least_loaded_healthy_engine_even_when_all_are_saturated() -> None:
    endpoints = [ep("a", waiting=9), ep("b", waiting=6), ep("c", healthy=False)]
    assert pick(KVFLEET, endpoints, RoutingContext(), random.Random(0)) is None
    assert pick(KVFLEET, endpoints, RoutingContext(must=True), random.Random(0)).url == "b"
    assert pick(KVFLEET, endpoints, RoutingContext(exclude=frozenset({"b"}), must=True), random.Random(0)).url == "a"


def test_endpoint_pool_ejects_after_repeated_failures_and_takes_it_back_after_the_cool_off() -> None:
    pool = EndpointPool(eject_after_failures=3, eject_seconds=10.0)
    pool.set_urls(["http://a"])
    pool.record_scrape("http://a", EngineLoad(0.1, 0, 0), now=100.0)
    assert not pool.record_outcome("http://a", False, now=100.0)
    assert not pool.record_outcome("http://a", False, now=100.0)
    assert pool.record_outcome("http://a", False, now=100.0)
    assert not pool.snapshots(now=105.0)[0].healthy
    assert pool.snapshots(now=110.01)[0].healthy


def test_a_success_resets_the_failure_count() -> None:
    pool = EndpointPool(eject_after_failures=2)
    pool.set_urls(["http://a"])
    pool.record_outcome("http://a", False)
    pool.record_outcome("http://a", True)
    assert not pool.record_outcome("http://a", False)


def test_dispatches_since_the_last_scrape_count_as_queue_until_the_next_scrape() -> None:
    pool = EndpointPool()
    pool.set_urls(["http://a"])
    pool.record_scrape("http://a", EngineLoad(0.1, 1, 2), now=1.0)
    for _ in range(3):
        pool.record_dispatch("http://a")
    assert pool.snapshots(now=1.01)[0].queue_depth == 4
    pool.record_scrape("http://a", EngineLoad(0.1, 1, 5), now=1.1)
    assert pool.snapshots(now=1.11)[0].queue_depth == 1


def test_open_requests_the_engine_has_not_shown_yet_count_as_queue_after_a_scrape() -> None:
    pool = EndpointPool()
    pool.set_urls(["http://a"])
    for _ in range(10):
        pool.record_dispatch("http://a")
    pool.record_scrape("http://a", EngineLoad(0.1, 2, 3), now=1.0)  # a busy engine has parsed 5 of the 10
    assert pool.snapshots(now=1.01)[0].queue_depth == 2 + 5
    for _ in range(5):
        pool.record_done("http://a", True)
    pool.record_scrape("http://a", EngineLoad(0.1, 0, 7), now=1.1)  # 5 ours and 2 of another gateway, all shown
    assert pool.snapshots(now=1.11)[0].queue_depth == 0


def test_engines_that_leave_discovery_leave_the_pool() -> None:
    pool = EndpointPool()
    assert pool.set_urls(["http://a", "http://b"]) == ({"http://a", "http://b"}, set())
    assert pool.set_urls(["http://b", "http://c"]) == ({"http://c"}, {"http://a"})
    assert sorted(pool.urls()) == ["http://b", "http://c"]


def test_a_never_scraped_engine_is_not_routed_to() -> None:
    pool = EndpointPool()
    pool.set_urls(["http://a"])
    assert not pool.snapshots()[0].healthy


@pytest.mark.parametrize("kwargs,message", [
    ({"engines": ["http://a:1"], "k8s_selector": "x", "k8s_namespace": "n"}, "not both"),
    ({"k8s_selector": "app=x"}, "--k8s-namespace"),
    ({"routing": "random"}, "kvfleet, least-request, round-robin"),
    ({"scrape_interval_s": 0.001}, "--scrape-interval"),
    ({"default_max_queue_ms": -1}, "--max-queue-ms"),
    ({"fleet": "a:b"}, "--fleet"),
    ({"fleet": "{x}"}, "--fleet"),
    ({"aging_ms": 0}, "--aging-ms"),
    ({"engines": ["localhost:8000"]}, "must start with http://"),
])
def test_bad_gateway_settings_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


def test_queue_caps_parsing() -> None:
    caps = parse_queue_caps("standard=5, sheddable=0")
    assert caps[S] == 5 and caps[X] == 0 and caps[C] == 1000
    for bad in ("standard", "urgent=3", "standard=many"):
        with pytest.raises(ValueError, match="class=count"):
            parse_queue_caps(bad)


def test_the_gateway_command_refuses_a_bad_engine_url_with_exit_2(capsys) -> None:
    from kvfleet.cli import main

    assert main(["gateway", "--engine", "http://10.0.0.5"]) == 2
    assert "has no port" in capsys.readouterr().err


@pytest.mark.parametrize("rate", [2.5, None])
def test_a_request_refused_for_its_deadline_is_told_why_even_when_the_drain_rate_has_gone(rate) -> None:
    """The queue refused it at one drain rate; the answer reads the rate again, and under load (the rate leaving
    its window, or the queue falling back from Redis to the replica's own) there may be none by then: still a 503
    that says what to change, never a 500."""
    from kvfleet.gateway.admission import queue_refusal
    from kvfleet.gateway.queue.order import Placement, Refusal

    reason, error = queue_refusal(Priority.STANDARD, "A", Placement(Refusal.TOO_LONG, 40), rate, 15_000, 256, 40)
    assert reason == "deadline_predicted" and error.status == 503
    assert "40 requests" in error.message and "15000 ms" in error.message and "x-kvfleet-max-queue-ms" in error.message
    assert int(error.headers["retry-after"]) >= 1
