"""The estimated-TTFT strategy (gateway/routing/pick.py): each engine's prompt tokens to compute before this request's
first token, over its measured prefill rate; the cached share of the prompt is free, other replicas' and this
gateway's unreported dispatches count, saturated engines are never chosen, and near-ties are split at random."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, SaturationPolicy
from kvfleet.gateway.routing.ttft import EstimatedTTFT

STRATEGY = EstimatedTTFT()


def engine(url: str, pending: int = 0, rate: float | None = 1000.0, **load: object) -> EndpointSnapshot:
    values = dict(healthy=True, kv_cache_usage=0.1, num_waiting=0, num_running=1, metrics_age_s=0.01,
                  max_num_seqs=8, prefill_tokens_pending=pending, prefill_rate=rate)
    values.update(load)
    return EndpointSnapshot(url, **values)


def choose(endpoints, matches=None, tokens=800, seed=0):
    request = RoutingContext(matches or {}, num_tokens=tokens)
    return STRATEGY.choose(endpoints, request, random.Random(seed)).url


def test_the_engine_holding_the_prompt_wins_until_its_queue_costs_more_than_computing_the_prompt_elsewhere() -> None:
    assert choose([engine("a"), engine("b")], {"a": 0.9}) == "a"
    # a holds 90% of an 800-token prompt: 80 tokens to compute, behind 500 pending; b computes all 800 at once
    assert choose([engine("a", pending=500), engine("b")], {"a": 0.9}) == "a"
    assert choose([engine("a", pending=1500), engine("b")], {"a": 0.9}) == "b"


def test_a_faster_engine_wins_for_the_same_work_and_an_unmeasured_one_gets_the_default_rate() -> None:
    assert choose([engine("slow", pending=400, rate=500.0), engine("fast", pending=400, rate=4000.0)]) == "fast"
    # rates within noise of each other (1.2x) are the same hardware: the work decides, not the noise
    assert choose([engine("a", pending=400, rate=1200.0), engine("b", pending=300, rate=1000.0)]) == "b"
    assert STRATEGY.estimate(engine("new", rate=None), RoutingContext({}, num_tokens=2000)) == 1.0
    # beside measured engines, an unmeasured one is taken to be as fast as their median
    fleet = [engine("new", rate=None, pending=800), engine("a", rate=1000.0, pending=1000),
             engine("b", rate=1000.0, pending=1000), engine("c", rate=50_000.0, pending=50_000)]
    assert choose(fleet, tokens=10) == "new"


def test_dispatches_the_engine_has_not_reported_yet_count_as_its_work() -> None:
    assert choose([engine("a", in_flight_tokens=5000), engine("b")], {"a": 0.5}) == "b"


def test_a_saturated_engine_is_never_chosen_however_well_it_holds_the_prompt() -> None:
    saturated = engine("a", num_waiting=SaturationPolicy().max_queue)
    assert choose([saturated, engine("b", pending=10_000)], {"a": 1.0}) == "b"
    assert STRATEGY.choose([saturated], RoutingContext({"a": 1.0}), random.Random(0)) is None


def test_near_ties_are_split_at_random_so_replicas_do_not_herd() -> None:
    fleet = [engine("a", pending=100), engine("b", pending=104), engine("c", pending=3000)]
    chosen = Counter(choose(fleet, seed=seed) for seed in range(200))
    assert set(chosen) == {"a", "b"} and min(chosen.values()) > 40


@given(st.lists(st.tuples(st.integers(0, 10**6), st.floats(1.0, 1e6), st.floats(0.0, 1.0)), min_size=1, max_size=8),
       st.integers(1, 10**5), st.integers(0, 2**32))
def test_the_choice_is_always_within_the_tie_tolerance_of_the_best_estimate(loads, tokens, seed) -> None:
    fleet = [engine(f"e{i}", pending=p, rate=r) for i, (p, r, _) in enumerate(loads)]
    matches = {f"e{i}": m for i, (_, _, m) in enumerate(loads)}
    request = RoutingContext(matches, num_tokens=tokens)
    chosen = STRATEGY.choose(fleet, request, random.Random(seed))
    rates = sorted(r for _, r, _ in loads)
    typical = rates[len(rates) // 2]
    best = min(STRATEGY.estimate(e, request, typical) for e in fleet)
    assert STRATEGY.estimate(chosen, request, typical) <= max(best * 1.1, best + 0.0005) * (1 + 1e-9)


def test_a_full_batch_makes_a_request_wait_for_a_slot_so_an_engine_with_free_slots_wins() -> None:
    full = engine("full", num_running=8, max_num_seqs=8, slot_seconds=2.0)
    free = engine("free", pending=50, num_running=2, max_num_seqs=8, slot_seconds=2.0)
    assert EstimatedTTFT.slot_wait(full) == 2.0 / 8 and EstimatedTTFT.slot_wait(free) == 0.0
    # 0.25 s for a slot on the engine holding the prompt; 0.15 s to compute all of it on the other
    assert choose([full, free], {"full": 1.0}, tokens=100) == "free"
    assert choose([full, free], {"full": 1.0}, tokens=400) == "full"
