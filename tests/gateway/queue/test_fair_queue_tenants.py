"""Who a request's tenant is and what share it has: the keys file's `weight=`, keys that share a name, and the
`x-kvfleet-tenant` header (checked without API keys, ignored with them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.fleet.errors import APIError
from kvfleet.gateway.limits.access import Tenant, request_tenant
from kvfleet.gateway.limits.keys import ApiKeyStore
from tests.support.paths import CHART


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


def test_a_keys_weight_is_its_tenants_share_and_defaults_to_one(tmp_path: Path) -> None:
    store = ApiKeyStore.from_file(keys_file(tmp_path, "sk-gold name=gold weight=2.5\nsk-free name=free\n"))
    gold, free = store.lookup("sk-gold"), store.lookup("sk-free")
    assert request_tenant(gold, {"x-kvfleet-tenant": "free"}) == Tenant("gold", 2.5)
    assert request_tenant(free, {}) == Tenant("free", 1.0)


@pytest.mark.parametrize("value", ["0", "-1", "0.001", "1001", "nan", "inf", "two", "1e9"])
def test_a_weight_out_of_range_is_refused_with_what_to_write(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match=rf"keys.txt line 1: weight={value} must be a number from 0.01 to 1000"):
        ApiKeyStore.from_file(keys_file(tmp_path, f"sk-x name=x weight={value}\n"))


def test_keys_with_one_name_are_one_tenant_and_must_give_the_same_weight_and_caps(tmp_path: Path) -> None:
    same = ApiKeyStore.from_file(keys_file(tmp_path, "sk-1 name=team weight=3 max_queued=5\n"
                                                     "sk-2 name=team weight=3 max_queued=5\n"))
    assert request_tenant(same.lookup("sk-1"), {}) == request_tenant(same.lookup("sk-2"), {}) \
        == Tenant("team", 3, max_queued=5)
    with pytest.raises(ValueError, match=r"keys.txt: keys named 'team' give different weights or caps "
                                         r"\(weight=3 max_queued=- max_inflight=- and weight=1 "):
        ApiKeyStore.from_file(keys_file(tmp_path, "sk-1 name=team weight=3\nsk-2 name=team\n"))
    with pytest.raises(ValueError, match=r"max_queued=-.* and .*max_queued=2 "):
        ApiKeyStore.from_file(keys_file(tmp_path, "sk-1 name=team\nsk-2 name=team max_queued=2\n"))
    with pytest.raises(ValueError, match=r"line 1: max_inflight=-1 must be a non-negative integer"):
        ApiKeyStore.from_file(keys_file(tmp_path, "sk-1 name=team max_inflight=-1\n"))


def test_without_keys_the_header_names_the_tenant_else_the_default_one() -> None:
    assert request_tenant(None, {"x-kvfleet-tenant": "team-b.eu_1"}) == Tenant("team-b.eu_1")
    assert request_tenant(None, {"x-kvfleet-tenant": ""}) == Tenant("default")
    assert request_tenant(None, {}) == Tenant("default")


@pytest.mark.parametrize("value", ["team a", "a" * 65, "tëam", "a:b", "{fleet}", "a|b"])
def test_a_malformed_tenant_header_is_a_400_that_says_what_to_send(value: str) -> None:
    with pytest.raises(APIError) as refused:
        request_tenant(None, {"x-kvfleet-tenant": value})
    body = refused.value.response().body.decode()
    assert refused.value.status == 400 and "x-kvfleet-tenant must be 1 to 64 letters, digits" in body


def test_the_charts_queue_policy_is_the_gateways_default_and_choices() -> None:
    import json

    import yaml

    from kvfleet.gateway.config import GatewayConfig
    from kvfleet.gateway.queue.fair_order import QUEUE_POLICIES
    chart = CHART
    values = yaml.safe_load((chart / "values.yaml").read_text())["gateway"]
    schema = json.loads((chart / "values.schema.json").read_text())["properties"]["gateway"]["properties"]
    assert values["queuePolicy"] == GatewayConfig().queue_policy == "fair"
    assert schema["queuePolicy"]["enum"] == list(QUEUE_POLICIES)


def test_the_charts_tenant_caps_and_metrics_defaults_are_the_gateways_and_reach_its_flags() -> None:
    import json

    import yaml

    from kvfleet.gateway.config import MAX_TENANT_METRICS_TOP, GatewayConfig
    from tests.support.chart import CHART, container, parse_cli, render
    values = yaml.safe_load((CHART / "values.yaml").read_text())["gateway"]
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["gateway"]["properties"]
    defaults = GatewayConfig()
    assert values["tenantMaxQueued"] is defaults.tenant_max_queued is None
    assert values["tenantMaxInflight"] is defaults.tenant_max_inflight is None
    assert values["tenantMetricsTop"] == defaults.tenant_metrics_top
    assert schema["tenantMetricsTop"]["maximum"] == MAX_TENANT_METRICS_TOP
    args, _ = parse_cli(container(render(), "gateway"))
    assert (args.tenant_max_queued, args.tenant_max_inflight, args.tenant_metrics_top) == (None, None, 20)
    args, _ = parse_cli(container(render(sets=("gateway.tenantMaxQueued=0", "gateway.tenantMaxInflight=8",
                                               "gateway.tenantMetricsTop=5")), "gateway"))
    assert (args.tenant_max_queued, args.tenant_max_inflight, args.tenant_metrics_top) == (0, 8, 5)
