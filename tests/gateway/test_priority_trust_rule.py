"""Priority is one concept: a header sets the class, only a trusted key may set the engine's priority in the body,
and each class maps to one engine priority (lower runs first, as in vLLM)."""

from __future__ import annotations

import pytest

from kvfleet.fleet.priority import (
    ENGINE_DEFAULT_PRIORITY,
    Priority,
    engine_priority,
    forwarded_engine_priority,
    parse_priority,
)


def test_the_header_sets_the_class_and_absent_means_standard() -> None:
    assert parse_priority(None) is Priority.STANDARD
    assert parse_priority("") is Priority.STANDARD
    assert parse_priority(" Critical ") is Priority.CRITICAL
    with pytest.raises(ValueError, match="x-kvfleet-priority must be one of critical, standard, sheddable"):
        parse_priority("urgent")


def test_classes_order_the_same_way_in_the_gateway_queue_and_in_the_engine() -> None:
    by_rank = sorted(Priority, key=lambda p: p.rank)
    assert by_rank == [Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE]
    engine_order = [engine_priority(p) for p in by_rank]
    assert engine_order == sorted(engine_order)  # never inverted on the way to the engine
    assert engine_priority(Priority.CRITICAL) < ENGINE_DEFAULT_PRIORITY


@pytest.mark.parametrize("priority", list(Priority))
def test_a_body_priority_is_kept_only_for_a_trusted_key(priority: Priority) -> None:
    assert forwarded_engine_priority(priority, -100, key_may_set=True, forward=True) == -100
    assert forwarded_engine_priority(priority, -100, key_may_set=True, forward=False) == -100
    untrusted = forwarded_engine_priority(priority, -100, key_may_set=False, forward=True)
    assert untrusted == forwarded_engine_priority(priority, None, key_may_set=False, forward=True)


def test_otherwise_the_engine_priority_comes_from_the_class_when_forwarded() -> None:
    assert forwarded_engine_priority(Priority.CRITICAL, None, key_may_set=False, forward=True) == -2
    assert forwarded_engine_priority(Priority.CRITICAL, None, key_may_set=True, forward=True) == -2
    assert forwarded_engine_priority(Priority.STANDARD, None, key_may_set=False, forward=True) is None
    assert forwarded_engine_priority(Priority.SHEDDABLE, 5, key_may_set=False, forward=True) is None
    assert forwarded_engine_priority(Priority.CRITICAL, 5, key_may_set=False, forward=False) is None


def test_a_standard_request_under_its_tenants_share_goes_ahead_of_its_class_but_behind_critical() -> None:
    from kvfleet.fleet.priority import UNDER_SHARE_ENGINE_PRIORITY
    boosted = forwarded_engine_priority(Priority.STANDARD, None, key_may_set=False, forward=True, under_share=True)
    assert boosted == UNDER_SHARE_ENGINE_PRIORITY
    assert engine_priority(Priority.CRITICAL) < boosted < ENGINE_DEFAULT_PRIORITY
    assert forwarded_engine_priority(Priority.SHEDDABLE, None, False, True, under_share=True) is None
    assert forwarded_engine_priority(Priority.CRITICAL, None, False, True, under_share=True) == -2
    assert forwarded_engine_priority(Priority.STANDARD, None, False, forward=False, under_share=True) is None
    assert forwarded_engine_priority(Priority.STANDARD, 7, True, True, under_share=True) == 7  # a trusted key's own


def test_a_tenant_is_under_its_share_while_it_holds_fewer_in_flight_than_an_equal_split() -> None:
    from kvfleet.gateway.limits.tenant_share import InFlightShares
    shares = InFlightShares()
    assert not shares.under_share("a")  # nothing in flight: nobody to go ahead of
    flood = [shares.start("flood") for _ in range(6)]
    assert shares.under_share("light") and not shares.under_share("flood")
    light = shares.start("light")
    assert shares.under_share("light")  # 1 of 7 with two tenants in flight
    ends = [shares.start("light") for _ in range(3)]
    assert shares.under_share("light")  # 4 of 10: still under an equal 5
    ends.append(shares.start("light"))
    ends.append(shares.start("light"))
    assert not shares.under_share("light") and not shares.under_share("flood")  # 6 and 6: equal
    for end in [*flood, *ends, light, light]:  # ending twice counts once
        end()
    assert not shares.under_share("flood") and not shares.under_share("light")
