"""Per-tenant metrics with bounded cardinality: the top N tenants by traffic are named and everyone else is "other",
whatever names clients send; a tenant that stops sending loses its series; labels do not flap. End to end, a real
gateway saturated in front of a real engine shows per-tenant queued, served, wait and shed series on /metrics."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.limits.tenant_metrics import OTHER, REFRESH_S, TenantLabels, TenantMetrics
from kvfleet.gateway.limits.usage import Settlement, Usage
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.token_estimate import request_cost
from tests.conftest import one_sequence_engine_fixtures, start_gateway, stop_process
from tests.support.clients import send
from tests.support.engines import saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

engine, model = one_sequence_engine_fixtures()

TENANT = "x-kvfleet-tenant"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every kvfleet_gateway_tenant_* sample in a /metrics text: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("kvfleet_gateway_tenant_")}


def tenants_exported(metrics: GatewayMetrics) -> set[str]:
    return {dict(labels)["tenant"] for _, labels in samples(generate_latest(metrics.registry).decode())}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


# ---- the labeller ---------------------------------------------------------------------------------------------

def test_the_top_n_tenants_are_named_and_the_rest_are_other() -> None:
    labels = TenantLabels(top=2)
    for tenant, requests in (("a", 10), ("b", 8), ("c", 5), ("d", 1)):
        for _ in range(requests):
            labels.observe(tenant, now=0.0)
    assert [labels.label(t) for t in "abcd"] == [OTHER] * 4  # nothing is decided before the next refresh
    change = labels.decide_if_due(now=REFRESH_S)
    assert change is not None and change.promoted == {"a", "b"} and not change.demoted
    assert [labels.label(t) for t in "abcde"] == ["a", "b", OTHER, OTHER, OTHER]


def test_top_zero_names_nobody() -> None:
    labels = TenantLabels(top=0)
    for second in range(100):
        labels.observe("a", now=float(second))
    assert labels.label("a") == OTHER and not labels.counts


def test_a_tenant_called_other_is_never_named_apart_from_the_others() -> None:
    labels = TenantLabels(top=2)
    for _ in range(50):
        labels.observe(OTHER, now=0.0)
        labels.observe("a", now=0.0)
    labels.decide(now=REFRESH_S)
    assert labels.named == {"a"}


def test_100k_random_names_keep_memory_and_series_bounded_and_the_heavy_tenants_named() -> None:
    clock, metrics, rng = Clock(), GatewayMetrics(), random.Random(16)
    tenants = TenantMetrics(metrics, top=20, clock=clock)
    most_counters = most_exported = 0
    ever_named: set[str] = set()
    for block in range(100):  # a second each: two real tenants, 30 fresh names sent 10 times, 600 sent once
        names = ["team-a"] * 50 + ["team-b"] * 50 + [f"burst-{block}-{i}" for i in range(30) for _ in range(10)]
        names += [f"junk-{rng.randrange(10**9)}" for _ in range(600)]
        rng.shuffle(names)
        for name in names:
            clock.now += 0.001
            tenants.arrived(name)
            tenants.served(name, 10)
            tenants.shed(name, "saturated")
        most_counters = max(most_counters, len(tenants.labels.counts))
        most_exported = max(most_exported, len(tenants_exported(metrics)))
        ever_named |= tenants.labels.named
    assert most_counters <= 4 * 20
    assert most_exported <= 20 + 1
    assert len(ever_named - {"team-a", "team-b"}) >= 10  # bursts were named in turn, their series removed again
    assert len(tenants._children) <= 3 * (20 + 1)  # served and shed per label, queued at most
    assert {"team-a", "team-b"} <= tenants.labels.named
    text = generate_latest(metrics.registry).decode()
    assert value(text, "kvfleet_gateway_tenant_served_tokens_total", tenant="team-a") > 0
    assert value(text, "kvfleet_gateway_tenant_served_tokens_total", tenant=OTHER) > 0


def test_a_tenant_that_stops_sending_is_demoted_and_its_series_removed() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    tenants = TenantMetrics(metrics, top=2, clock=clock)
    for _ in range(30):
        clock.now += 0.1
        for name in ("a", "b"):
            tenants.arrived(name)
    clock.now += REFRESH_S
    tenants.refresh()
    for name in ("a", "b"):
        tenants.served(name, 5)
        tenants.shed(name, "deadline")
        tenants.shed(name, "queue_full")
        tenants.waited(name, 0.2)
    assert tenants_exported(metrics) == {"a", "b", OTHER}
    for _ in range(600):  # ten minutes: only b sends
        clock.now += 1.0
        tenants.arrived("b")
        tenants.served("b", 5)
    assert tenants.labels.named == {"b"}
    assert tenants_exported(metrics) == {"b", OTHER}  # a's served, shed (both reasons) and wait series are gone
    clock.now += 3600  # an hour with no traffic at all: a scrape still demotes b
    tenants.refresh()
    assert tenants_exported(metrics) == {OTHER}


def test_labels_do_not_flap_between_two_close_tenants_but_follow_a_clear_change() -> None:
    labels = TenantLabels(top=1)
    named: list[frozenset[str]] = []
    now = 0.0
    for step in range(6000):  # ten minutes of a 3:2 mix
        now += 0.1
        labels.observe("a" if step % 5 in (0, 2, 4) else "b", now)
        if labels.named != (named[-1] if named else frozenset()):
            named.append(labels.named)
    assert named == [{"a"}]
    assert labels.label("b") == OTHER
    for step in range(3000):  # b now sends four times as much as a
        now += 0.1
        labels.observe("a" if step % 5 == 0 else "b", now)
    assert labels.named == {"b"}


def test_the_queued_gauge_follows_a_tenant_relabelled_while_it_waits() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    tenants = TenantMetrics(metrics, top=1, clock=clock)
    tenants.arrived("a")
    tenants.queued("a", +1)
    tenants.queued("a", +1)
    text = generate_latest(metrics.registry).decode()
    assert value(text, "kvfleet_gateway_tenant_queued", tenant=OTHER) == 2
    for _ in range(5):
        tenants.arrived("a")
    clock.now += REFRESH_S
    tenants.refresh()  # a is named while two of its requests wait
    text = generate_latest(metrics.registry).decode()
    assert value(text, "kvfleet_gateway_tenant_queued", tenant="a") == 2
    assert value(text, "kvfleet_gateway_tenant_queued", tenant=OTHER) == 0
    tenants.queued("a", -1)
    tenants.queued("a", -1)
    text = generate_latest(metrics.registry).decode()
    assert value(text, "kvfleet_gateway_tenant_queued", tenant="a") == 0
    assert value(text, "kvfleet_gateway_tenant_queued", tenant=OTHER) == 0


def test_served_tokens_are_the_engines_count_and_the_inner_settlement_is_unchanged() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    tenants = TenantMetrics(metrics, top=1, clock=clock)
    body = {"prompt": "x" * 40, "max_tokens": 100}
    settled: list[int] = []
    for usage in (Usage(37), Usage(None, streamed_events=4), Usage(None, streamed_events=None)):
        inner = Settlement(request_cost(body), settled.append)
        outer = tenants.counted("a", inner, body)
        outer(usage)
        outer.refund()  # a no-op once settled, as for the inner one
    alone = tenants.counted("a", None, body)  # no key, no fair share: a settlement for the count alone
    alone(Usage(13))
    abandoned = tenants.counted("a", None, body)
    abandoned.abandoned()
    assert settled == [37, 10 + 4, 110]  # what the inner settlement would have settled by itself
    text = generate_latest(metrics.registry).decode()
    assert value(text, "kvfleet_gateway_tenant_served_tokens_total", tenant=OTHER) == 37 + 13


def test_the_flag_is_checked_with_a_message_that_says_what_to_write() -> None:
    from kvfleet.cli import build_parser
    from kvfleet.gateway.cli_args import gateway_config_from_args

    assert GatewayConfig().tenant_metrics_top == 20
    assert gateway_config_from_args(build_parser().parse_args(["gateway", "--tenant-metrics-top", "0"])) \
        .tenant_metrics_top == 0
    for bad in (-1, 1001):
        with pytest.raises(ValueError, match="--tenant-metrics-top must be a whole number from 0 .* to 1000"):
            GatewayConfig(tenant_metrics_top=bad)


# ---- a real gateway ---------------------------------------------------------------------------------------------

def complete(url: str, model: str, tenant: str, priority: str = "standard") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": tenant, "max_tokens": 2},
                      headers={TENANT: tenant, "x-kvfleet-priority": priority}, timeout=60)


@pytest.mark.parametrize("data_plane,policy", [("python", "fcfs"), ("envoy", "fair")])
def test_a_saturated_gateway_exports_the_top_tenant_by_name_and_the_rest_as_other(engine, model, redis_server,
                                                                                  data_plane, policy) -> None:
    proc, url = start_gateway("--engine", engine, "--redis-url", redis_server.url, "--fleet", f"tm-{policy}",
                              "--saturation-queue", "1", "--data-plane", data_plane, "--queue-policy", policy,
                              "--tenant-metrics-top", "1")
    try:
        wait_until_routable(url)
        served = {"big": 0, OTHER: 0}
        for tenant in ["big"] * 6 + ["small"] * 3:  # big sends the most, small is eligible but not in the top 1
            answer = complete(url, model, tenant)
            assert answer.status_code == 200, answer.text
            served[OTHER] += answer.json()["usage"]["total_tokens"]  # nobody is named yet
        time.sleep(REFRESH_S + 0.5)
        httpx.get(f"{url}/metrics", timeout=10)  # the labels are re-decided (at most every REFRESH_S)

        before = httpx.get(f"{url}/metrics", timeout=10).text  # a sequential request may have queued a moment
        waits = {t: value(before, "kvfleet_gateway_tenant_queue_wait_seconds_count", tenant=t) for t in ("big", OTHER)}
        results: dict = {}
        plan = ["big"] * 3 + ["small"] * 2
        threads = [threading.Thread(target=send, args=(url, model, "standard", results, f"{t}{i}"),
                                    kwargs={TENANT: t}) for i, t in enumerate(plan)]
        with saturated(engine, model, (url,)):
            for t in threads:
                t.start()

            def queued() -> tuple[float, float]:
                text = httpx.get(f"{url}/metrics", timeout=10).text
                return (value(text, "kvfleet_gateway_tenant_queued", tenant="big"),
                        value(text, "kvfleet_gateway_tenant_queued", tenant=OTHER))
            until(lambda: queued() == (3, 2), f"the requests never queued by tenant: {queued()}")
            shed = complete(url, model, "big", priority="sheddable")
            assert shed.status_code == 429
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r, _ in results.values()), results
        for name, (answer, _) in results.items():
            served["big" if name.startswith("big") else OTHER] += answer.json()["usage"]["total_tokens"]

        def exported() -> str:
            return httpx.get(f"{url}/metrics", timeout=10).text
        until(lambda: (value(exported(), "kvfleet_gateway_tenant_served_tokens_total", tenant="big"),
                       value(exported(), "kvfleet_gateway_tenant_served_tokens_total", tenant=OTHER))
              == (served["big"], served[OTHER]), f"served tokens are not {served}: {samples(exported())}", 10)
        text = exported()
        print({k: v for k, v in samples(text).items() if not k[0].endswith("_bucket")})
        assert value(text, "kvfleet_gateway_tenant_queue_wait_seconds_count", tenant="big") - waits["big"] == 3
        assert value(text, "kvfleet_gateway_tenant_queue_wait_seconds_count", tenant=OTHER) - waits[OTHER] == 2
        assert value(text, "kvfleet_gateway_tenant_queued", tenant="big") == 0
        assert value(text, "kvfleet_gateway_tenant_queued", tenant=OTHER) == 0
        assert value(text, "kvfleet_gateway_tenant_shed_total", tenant="big", reason="saturated") == 1
        assert {dict(labels)["tenant"] for _, labels in samples(text)} == {"big", OTHER}  # "small" has no series
    finally:
        stop_process(proc)
