"""Routing as scorers chooses exactly what the former string-dispatched pick() chose, for every strategy.

The former pick() is kept below only as the reference: same snapshots, request and random seed must give the same
endpoint and leave the random generator in the same state (so later decisions agree too).
"""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvfleet.gateway.config import ROUTING_STRATEGIES
from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, SaturationPolicy, ScoreWeights, pick
from kvfleet.gateway.routing.scorers import KVHeadroom, PrefixMatch, QueueRoom
from kvfleet.gateway.routing.strategies import STRATEGIES, strategy_named

# --- the former routing code, verbatim but for names --------------------------------------------------------------


def old_score(e: EndpointSnapshot, prefix_match: float, weights: ScoreWeights, policy: SaturationPolicy) -> float:
    if e.max_num_seqs:
        held = e.num_running + e.num_waiting + e.in_flight
        queue_room = max(0.0, 1.0 - held / (e.max_num_seqs + policy.max_queue))
    else:
        queue_room = max(0.0, 1.0 - e.queue_depth / policy.max_queue)
    kv_room = max(0.0, 1.0 - e.kv_cache_usage)
    return weights.queue * queue_room + weights.kv * kv_room + weights.prefix * prefix_match


def old_available(endpoints: list[EndpointSnapshot], policy: SaturationPolicy) -> list[EndpointSnapshot]:
    return [e for e in endpoints if e.healthy and not policy.is_saturated(e)]


def old_pick_by_score(endpoints, prefix_matches, rng, weights, policy, tie_tolerance=0.05):
    candidates = old_available(endpoints, policy)
    if not candidates:
        return None
    scored = [(old_score(e, prefix_matches.get(e.url, 0.0), weights, policy), e) for e in candidates]
    best = max(s for s, _ in scored)
    near = [(s, e) for s, e in scored if s >= best - tie_tolerance]
    if len(near) == 1:
        return near[0][1]
    first, second = rng.sample(near, 2)
    return first[1] if first[0] >= second[0] else second[1]


def old_pick_least_request(endpoints, rng, policy):
    candidates = old_available(endpoints, policy)
    if not candidates:
        return None
    fewest = min(e.num_running + e.queue_depth for e in candidates)
    return rng.choice([e for e in candidates if e.num_running + e.queue_depth == fewest])


def old_pick_round_robin(endpoints, counter):
    healthy = [e for e in endpoints if e.healthy]
    return healthy[counter % len(healthy)] if healthy else None


def old_pick(strategy, endpoints, prefix_matches, rng, counter, weights, policy, exclude, must):
    endpoints = [e for e in endpoints if e.url not in exclude]
    if strategy == "round-robin":
        chosen = old_pick_round_robin(endpoints, counter)
    elif strategy == "least-request":
        chosen = old_pick_least_request(endpoints, rng, policy)
    else:
        chosen = old_pick_by_score(endpoints, prefix_matches, rng, weights, policy)
    if chosen is None and must:
        healthy = [e for e in endpoints if e.healthy]
        if healthy:
            chosen = min(healthy, key=lambda e: (e.queue_depth, e.kv_cache_usage, rng.random()))
    return chosen


# --- random fleets --------------------------------------------------------------------------------------------------

# Coarse values make exact ties and near-ties (the tie-break path) common; floats cover the rest.
KV = st.sampled_from([0.0, 0.1, 0.5, 0.79, 0.8, 1.0]) | st.floats(0, 1)
SHARE = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1)
ROW = st.tuples(st.booleans() | st.just(True), KV, st.integers(0, 8), st.integers(0, 8),
                st.sampled_from([0.0, 0.05, 0.2, 0.3]), st.integers(0, 6), st.none() | st.integers(0, 12))


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[EndpointSnapshot], dict[str, float], frozenset[str]]:
    rows = draw(st.lists(ROW, min_size=0, max_size=7))
    endpoints = [EndpointSnapshot(f"e{i}", healthy, kv, waiting, running, age, in_flight, capacity)
                 for i, (healthy, kv, waiting, running, age, in_flight, capacity) in enumerate(rows)]
    urls = [e.url for e in endpoints]
    matches = draw(st.dictionaries(st.sampled_from(urls), SHARE) if urls else st.just({}))
    exclude = frozenset(draw(st.sets(st.sampled_from(urls))) if urls else ())
    return endpoints, matches, exclude


# Once found only by chance: two engines whose queue rooms (0.95, 0.9) lie exactly the tie tolerance apart; a signal
# that added the same constant to both totals moved them across it by rounding.
@example(([EndpointSnapshot("e0", True, 0.0, 0, 0, 0.0, 1), EndpointSnapshot("e1", True, 0.0, 0, 0, 0.0, 2)], {},
          frozenset()), "kvfleet", False, 0, 0, ScoreWeights(1.0, 0.0, 5.0), SaturationPolicy(20, 1.0, 1.0))
@settings(max_examples=600, deadline=None)
@given(fleets(), st.sampled_from(["kvfleet", "round-robin"]), st.booleans(), st.integers(0, 50),
       st.integers(0, 2**32),
       st.sampled_from([ScoreWeights(), ScoreWeights(1.0, 0.0, 5.0), ScoreWeights(0.5, 3.0, 0.0)]),
       st.sampled_from([SaturationPolicy(), SaturationPolicy(2, 0.5, 0.25), SaturationPolicy(20, 1.0, 1.0)]))
def test_every_strategy_chooses_as_the_former_pick_did(fleet, name, must, turn, seed, weights, policy) -> None:
    endpoints, matches, exclude = fleet
    old_rng, new_rng = random.Random(seed), random.Random(seed)
    expected = old_pick(name, endpoints, matches, old_rng, turn, weights, policy, exclude, must)
    chosen = pick(strategy_named(name, weights, policy), endpoints, RoutingContext(matches, exclude, must, turn),
                  new_rng)
    assert chosen == expected
    assert new_rng.getstate() == old_rng.getstate(), "the random generator was drawn from differently"


@given(fleets())
def test_each_signal_scores_every_candidate_between_zero_and_one(fleet) -> None:
    endpoints, matches, _ = fleet
    request = RoutingContext(matches)
    for scorer in (QueueRoom(SaturationPolicy().max_queue), KVHeadroom(), PrefixMatch()):
        values = scorer.scores(endpoints, request)
        assert len(values) == len(endpoints) and all(0.0 <= v <= 1.0 for v in values)


def test_routing_flag_offers_exactly_the_registered_strategies() -> None:
    assert ROUTING_STRATEGIES == tuple(STRATEGIES) == ("kvfleet", "least-request", "round-robin", "estimated-ttft",
                                                               "prefix-affinity")


def test_least_request_counts_the_requests_it_sent_since_the_scrape_even_into_free_batch_slots() -> None:
    """Between two scrapes every pick would otherwise go to the same engine (herding onto it)."""
    from kvfleet.gateway.routing.pick import LeastRequest

    fleet = [EndpointSnapshot("a", True, 0.1, 0, 1, 0.01, in_flight=2, max_num_seqs=8),
             EndpointSnapshot("b", True, 0.1, 0, 2, 0.01, in_flight=0, max_num_seqs=8)]
    assert LeastRequest().choose(fleet, RoutingContext(), random.Random(0)).url == "b"
