"""The noisy-neighbour benchmark's figures: Jain's index, max-min fair shares, who counts as backlogged, order
displacement, latency percentiles, and the seeded per-tenant workload."""

from __future__ import annotations

import pytest

from bench.fair_order_check import in_process_order, order_displacement, order_script
from bench.noisy_neighbour import (
    Record,
    backlogged,
    jain_index,
    latency_quantiles,
    max_min_fair_shares,
    plan_tenants,
    summarize_arm,
)


def test_jain_index_is_one_for_equal_shares_and_one_over_n_when_one_takes_all() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0, 2.0]) == pytest.approx(9 / 10)
    assert jain_index([]) is None


def test_light_tenants_get_their_demand_and_the_flood_gets_the_rest() -> None:
    shares = max_min_fair_shares({"A": 500.0, "B": 10.0, "C": 10.0}, capacity=100.0)
    assert shares == pytest.approx({"A": 80.0, "B": 10.0, "C": 10.0})
    assert backlogged({"A": 500.0, "B": 10.0, "C": 10.0}, shares) == ["A"]


def test_two_floods_split_what_the_light_tenant_leaves_evenly() -> None:
    demands = {"A": 500.0, "B": 90.0, "C": 10.0}
    shares = max_min_fair_shares(demands, capacity=100.0)
    assert shares == pytest.approx({"A": 45.0, "B": 45.0, "C": 10.0})
    assert backlogged(demands, shares) == ["A", "B"]


def test_nobody_is_backlogged_when_capacity_covers_every_demand() -> None:
    demands = {"B": 10.0, "C": 12.0}
    shares = max_min_fair_shares(demands, capacity=22.0)
    assert shares == pytest.approx(demands)
    assert backlogged(demands, shares) == []


def test_order_displacement_in_percent_of_n() -> None:
    assert order_displacement([1, 2, 3, 4], [1, 2, 3, 4]) == {"n": 4, "mean_pct": 0.0, "max_pct": 0.0, "missing": 0}
    swapped = order_displacement(list(range(10)), [1, 0, *range(2, 10)])
    assert swapped["mean_pct"] == pytest.approx(2.0) and swapped["max_pct"] == pytest.approx(10.0)
    lost = order_displacement([1, 2, 3, 4], [2, 3, 4])
    assert lost["missing"] == 1 and lost["max_pct"] == pytest.approx(100.0)


def test_latency_percentiles_interpolate_and_are_empty_without_answers() -> None:
    q = latency_quantiles([float(x) for x in range(1, 101)])
    assert q["p50"] == pytest.approx(50.5) and q["p99"] == pytest.approx(99.01)
    assert latency_quantiles([]) == {"p50": None, "p90": None, "p99": None}


def test_the_plan_is_seeded_per_tenant_and_keeps_each_tenants_rate() -> None:
    plan = plan_tenants({"A": 20.0, "B": 1.0}, duration_s=50.0, prompt_words=8, seed=1)
    assert plan == plan_tenants({"A": 20.0, "B": 1.0}, duration_s=50.0, prompt_words=8, seed=1)
    assert [p.send_at for p in plan] == sorted(p.send_at for p in plan) and plan[-1].send_at < 50.0
    counts = {t: sum(p.tenant == t for p in plan) for t in "AB"}
    assert 850 < counts["A"] < 1150 and 30 < counts["B"] < 75
    # B's requests are the same whether or not A floods: the arms without A send exactly them
    only_b = plan_tenants({"B": 1.0, "A": 20.0}, 50.0, 8, 1)
    assert [p.send_at for p in only_b if p.tenant == "B"] == [p.send_at for p in plan if p.tenant == "B"]


def test_an_arm_summary_counts_lost_requests_and_fair_share_use() -> None:
    records = [Record(i, "A", 0.0, 0, 200, 1.0, 10, 6) for i in range(8)]
    records += [Record(8 + i, "A", 0.0, 0, 503) for i in range(10)]
    records += [Record(20, "B", 0.0, 1, 200, 0.5, 10, 6, retried="connect"), Record(21, "B", 0.0, 1, None,
                                                                                       retried="connection lost")]
    s = summarize_arm(records, ("A", "B"))
    assert s["tenants"]["A"]["status"] == {"200": 8, "429": 0, "503": 10, "lost": 0, "other": 0}
    assert s["tenants"]["B"]["status"]["lost"] == 1 and s["lost"] == 1 and s["answered"] == 19
    assert s["retried"] == {"connect": 1, "connection lost": 1, "answered": 1}
    # B asked for 2 x 16 tokens of 144 served and got 16: half its share; A, the only backlogged one, got 128 of 112
    assert s["backlogged"] == ["A"] and s["jain_backlogged"] == pytest.approx(1.0)
    assert s["tenants"]["B"]["served_over_share"] == pytest.approx(0.5)
    assert s["jain_share"] < 0.95


def test_the_order_script_runs_through_the_in_process_policy_and_releases_everything() -> None:
    script = order_script(seed=2)
    enqueued = [i for i, (op, _) in enumerate(script) if op == "enqueue"]
    order = in_process_order(script)
    assert sorted(order) == enqueued and len(order) > 100
    assert order != enqueued  # fair share reorders the bursts
