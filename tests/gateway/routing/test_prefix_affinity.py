"""Prefix affinity (gateway/routing/ttft.py): the engine holding a prompt keeps it until waiting there costs more
than `stickiness` times the prefill its cache saves; a prompt no engine holds goes to the lowest estimated time to
first token; a saturated engine takes nothing while another has room; with every engine saturated the request
waits in the gateway, and once released the cache still decides."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, SaturationPolicy, pick
from kvfleet.gateway.routing.strategies import strategy_named
from kvfleet.gateway.routing.ttft import PrefixAffinity

STRATEGY = PrefixAffinity(stickiness=4.0)


def engine(url: str, pending: int = 0, **load: object) -> EndpointSnapshot:
    values = dict(healthy=True, kv_cache_usage=0.1, num_waiting=0, num_running=1, metrics_age_s=0.01,
                  max_num_seqs=8, prefill_tokens_pending=pending, prefill_rate=1000.0)
    values.update(load)
    return EndpointSnapshot(url, **values)


def choose(endpoints, matches=None, tokens=1000, must=False, seed=0):
    chosen = pick(STRATEGY, endpoints, RoutingContext(matches or {}, num_tokens=tokens, must=must),
                  random.Random(seed))
    return None if chosen is None else chosen.url


def test_the_holder_keeps_its_tenant_while_behind_by_less_than_four_times_the_prefill_it_saves() -> None:
    # a holds 90% of a 1,000-token prompt: its hit saves 0.9 s of prefill at 1,000 tokens/s (4x: 3.6 s); b starts
    # the whole prompt at once (1.0 s), a after its pending work plus the 100 uncached tokens
    assert choose([engine("a", pending=4000), engine("b")], {"a": 0.9}) == "a"  # 4.1 s: 3.1 s behind, stays
    assert choose([engine("a", pending=5000), engine("b")], {"a": 0.9}) == "b"  # 5.1 s: 4.1 s behind, moves


def test_lowest_ttft_would_have_moved_the_tenant_long_before_affinity_does() -> None:
    """What sets it apart from estimated-ttft: a 0.5 s queue moves nothing, where lowest-TTFT would re-compute the
    prompt elsewhere (and evict another tenant's prefix there to make room)."""
    fleet = [engine("a", pending=1500), engine("b")]
    assert choose(fleet, {"a": 0.9}) == "a"
    ttft = strategy_named("estimated-ttft")
    assert ttft.choose(fleet, RoutingContext({"a": 0.9}, num_tokens=1000), random.Random(0)).url == "b"


def test_a_prompt_below_the_minimum_match_goes_where_it_starts_soonest() -> None:
    assert choose([engine("a", pending=900), engine("b", pending=100)], {"a": 0.2}) == "b"
    assert choose([engine("a", pending=900), engine("b", pending=100)]) == "b"


def test_with_every_engine_saturated_it_waits_and_once_released_the_cache_decides() -> None:
    full = SaturationPolicy().max_queue
    fleet = [engine("a", num_waiting=full, pending=500), engine("b", num_waiting=full + 3, pending=2500)]
    assert choose(fleet, {"b": 0.95}) is None  # waits in the gateway's queue
    assert choose(fleet, {"b": 0.95}, must=True) == "b"  # released: still its holder, not the least loaded


def test_a_saturated_holder_beside_a_free_engine_gives_way_even_within_the_bound() -> None:
    """The saturation filter comes first, as in the Inference Extension's scheduler: an engine whose queue reached
    the limit takes no more while another has room. Where the estimate cannot see an engine's decode load (a vLLM
    engine before any request has finished there: no slot time yet), the bound alone let one prompt's burst pile
    onto its holder with the other engine idle."""
    fleet = [engine("a", num_waiting=SaturationPolicy().max_queue, pending=1200), engine("b")]
    assert choose(fleet, {"a": 0.9}) == "b"
    assert choose([engine("a", num_waiting=SaturationPolicy().max_queue - 1, pending=1200), engine("b")],
                  {"a": 0.9}) == "a"


def test_unhealthy_engines_are_never_chosen() -> None:
    assert choose([engine("a", healthy=False), engine("b", pending=50_000)], {"a": 1.0}) == "b"
    assert choose([engine("a", healthy=False)], {"a": 1.0}, must=True) is None


@given(st.lists(st.tuples(st.integers(0, 20_000), st.floats(0, 1), st.booleans()), min_size=1, max_size=6),
       st.integers(1, 4000), st.booleans())
def test_any_choice_is_a_healthy_engine_and_the_holder_is_never_left_for_a_slower_start(rows, tokens, must) -> None:
    fleet = [engine(f"e{i}", pending=p, healthy=h) for i, (p, _, h) in enumerate(rows)]
    matches = {f"e{i}": m for i, (_, m, _) in enumerate(rows)}
    url = choose(fleet, matches, tokens=tokens, must=must)
    healthy = {e.url for e in fleet if e.healthy}
    if url is None:
        assert not healthy or not must and all(SaturationPolicy().is_saturated(e) for e in fleet if e.healthy)
        return
    assert url in healthy
    chosen = next(e for e in fleet if e.url == url)
    estimate = STRATEGY.ttft.estimate
    typical = 1000.0
    request = RoutingContext(matches, num_tokens=tokens)
    best = min(estimate(e, request, typical) for e in fleet if e.healthy)
    # leaving the best start is paid for only by a hit: never more than 4x the prefill it saves (near-ties aside)
    saved = tokens * matches[url] / typical
    assert estimate(chosen, request, typical) - best <= 4.0 * saved + 0.1 * best + 1e-3
