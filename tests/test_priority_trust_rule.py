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
    assert forwarded_engine_priority(Priority.CRITICAL, None, key_may_set=False, forward=True) == -1
    assert forwarded_engine_priority(Priority.CRITICAL, None, key_may_set=True, forward=True) == -1
    assert forwarded_engine_priority(Priority.STANDARD, None, key_may_set=False, forward=True) is None
    assert forwarded_engine_priority(Priority.SHEDDABLE, 5, key_may_set=False, forward=True) is None
    assert forwarded_engine_priority(Priority.CRITICAL, 5, key_may_set=False, forward=False) is None
