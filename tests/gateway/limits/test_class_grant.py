"""Who may claim the critical class: an API key's `max_class=`, else the gateway's `--max-class` (every request
without API keys); a claim above it is a 403 that says what to send, and is not counted as an arrival of its class.

Pure tests of the key option, the flag and the decision (gateway/limits/class_grant.py), then real gateways in front of
a real engine: one with keys behind Envoy (the endpoint picker's path) and Redis (the SLO counts), one without keys
on the Python proxy, and one with today's default, which still takes critical from anyone.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import openai
import pytest

from kvfleet.fleet.headers import PRIORITY
from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo_stats import read_class_windows
from kvfleet.gateway.cli_args import add_gateway_args, gateway_config_from_args
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.limits.class_grant import class_ceiling, class_refusal, may_claim
from kvfleet.gateway.limits.keys import ApiKeyStore, hash_key, parse_key_lines
from tests.conftest import start_gateway, stop_process
from tests.support.gateways import until_metric, wait_until_routable

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE
STANDARD_KEY = "sk-standard-" + "s" * 20
INHERITING_KEY = "sk-inherits-" + "i" * 20  # no max_class=: the gateway's --max-class
CRITICAL_KEY = "sk-critical-" + "c" * 20
BATCH_KEY = "sk-batch-" + "b" * 20
FLEET = "grant"


# ---- the key option -------------------------------------------------------------------------------------------
def one_key(line: str):
    return next(iter(parse_key_lines(line, "keys.txt").values()))


def test_a_key_names_the_highest_class_it_may_claim_and_defaults_to_the_gateways() -> None:
    assert one_key(f"{STANDARD_KEY} name=a max_class=standard").max_class is S
    assert one_key(f"{STANDARD_KEY} max_class=Critical").max_class is C
    assert one_key(f"{STANDARD_KEY} max_class=sheddable rpm=5").max_class is X
    assert one_key(f"{STANDARD_KEY} name=a").max_class is None
    store = ApiKeyStore.from_text(f"sha256:{hash_key(BATCH_KEY)} max_class=sheddable")
    assert store.authenticate(f"Bearer {BATCH_KEY}").max_class is X


@pytest.mark.parametrize(("line", "error"), [
    (f"{STANDARD_KEY} max_class=urgent", "keys.txt line 1: max_class=urgent must be one of critical, standard, "
                                         "sheddable (the highest x-kvfleet-priority the key may send"),
    (f"{STANDARD_KEY} max_class=", "keys.txt line 1: max_class= needs a value"),
    (f"{STANDARD_KEY} max_class=standard max_class=critical", "keys.txt line 1: max_class= is given twice"),
    (f"max_class=standard {STANDARD_KEY}", "keys.txt line 1: the key must come first, before max_class="),
    (f"{STANDARD_KEY} maxclass=standard", "expected name=, rpm=, tpm=, weight=, max_queued=, max_inflight=, "
                                          "allow_priority=, allow_fallback=, max_class= or batch_tokens="),
])
def test_a_malformed_max_class_names_the_line_and_what_to_write(line: str, error: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_key_lines(line, "keys.txt")
    assert error in str(raised.value)


# ---- the flag --------------------------------------------------------------------------------------------------
def gateway_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser


def test_the_gateway_takes_critical_from_anyone_unless_told_otherwise() -> None:
    assert GatewayConfig().max_class is C
    assert gateway_config_from_args(gateway_parser().parse_args([])).max_class is C
    assert gateway_config_from_args(gateway_parser().parse_args(["--max-class", "standard"])).max_class is S
    with pytest.raises(SystemExit):
        gateway_parser().parse_args(["--max-class", "urgent"])
    with pytest.raises(ValueError, match="--max-class must be one of critical, standard, sheddable, not 'urgent'"):
        GatewayConfig(max_class="urgent")


# ---- the decision ----------------------------------------------------------------------------------------------
def test_a_keys_own_max_class_overrides_the_gateways() -> None:
    standard, inheriting = one_key(f"{STANDARD_KEY} max_class=standard"), one_key(INHERITING_KEY)
    critical = one_key(f"{CRITICAL_KEY} max_class=critical")
    assert class_ceiling(None, S) is S  # no API keys: the gateway's, for every request
    assert class_ceiling(inheriting, S) is S and class_ceiling(inheriting, C) is C
    assert class_ceiling(standard, C) is S and class_ceiling(critical, X) is C


@pytest.mark.parametrize("ceiling", list(Priority))
def test_a_claim_is_allowed_at_or_below_the_ceiling_and_refused_above(ceiling: Priority) -> None:
    allowed = {p for p in Priority if class_refusal(p, ceiling, keyed=True) is None}
    assert allowed == {p for p in Priority if p.rank >= ceiling.rank} == {p for p in Priority if may_claim(p, ceiling)}


def test_a_refusal_is_a_403_that_says_what_to_send_and_how_to_get_more() -> None:
    keyed = class_refusal(C, S, keyed=True)
    assert (keyed.status, keyed.type, keyed.param, keyed.code) == (403, "permission_error", PRIORITY,
                                                                   "class_not_allowed")
    assert keyed.message == ("this API key may send x-kvfleet-priority up to standard, not critical; send standard "
                             "or sheddable, or ask for a key with max_class=critical")
    assert class_refusal(C, S, keyed=False).message == (
        "this gateway (--max-class standard) accepts x-kvfleet-priority up to standard, not critical; send standard "
        "or sheddable, or ask its operator for an API key with max_class=critical")
    assert "(a request without it is standard); send sheddable," in class_refusal(S, X, keyed=True).message


# ---- real gateways in front of a real engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_server: str) -> str:
    return httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def gateways(tiny_server: str, redis_server_module, tmp_path_factory) -> dict[str, str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{STANDARD_KEY} name=standard max_class=standard\n{INHERITING_KEY} name=inherits\n"
                    f"{CRITICAL_KEY} name=critical max_class=critical\n{BATCH_KEY} name=batch max_class=sheddable\n")
    started = {
        "keys": start_gateway("--engine", tiny_server, "--api-keys-file", str(keys), "--max-class", "standard",
                              "--redis-url", redis_server_module.url, "--fleet", FLEET),
        "open": start_gateway("--engine", tiny_server, "--max-class", "standard", "--data-plane", "python"),
        "default": start_gateway("--engine", tiny_server),
    }
    for _, url in started.values():
        wait_until_routable(url)
    yield {name: url for name, (_, url) in started.items()}
    for proc, _ in started.values():
        stop_process(proc)


def complete(gateway: str, key: str, model: str, priority: str | None) -> str:
    """The completion's finish reason; openai's error for a refusal."""
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=60)
    extra = {PRIORITY: priority} if priority is not None else None
    answer = client.completions.create(model=model, prompt="hello", max_tokens=3, extra_headers=extra,
                                       extra_body={"ignore_eos": True})
    return answer.choices[0].finish_reason


def refusal(gateway: str, key: str, model: str, priority: str | None) -> dict:
    with pytest.raises(openai.PermissionDeniedError) as refused:
        complete(gateway, key, model, priority)
    assert refused.value.status_code == 403
    return refused.value.body


def test_a_key_granted_standard_gets_a_403_for_critical_and_is_served_standard(gateways: dict[str, str],
                                                                                model: str) -> None:
    url = gateways["keys"]
    body = refusal(url, STANDARD_KEY, model, "critical")
    assert body == {"message": "this API key may send x-kvfleet-priority up to standard, not critical; send standard "
                               "or sheddable, or ask for a key with max_class=critical",
                    "type": "permission_error", "param": PRIORITY, "code": "class_not_allowed"}
    assert complete(url, STANDARD_KEY, model, "standard") == "length"
    assert complete(url, STANDARD_KEY, model, None) == "length"  # absent: standard
    until_metric(url, 'kvfleet_gateway_requests_total{code="403",priority="critical"}')


def test_keys_without_max_class_get_the_gateways_and_a_granted_key_may_claim_critical(
        gateways: dict[str, str], model: str, redis_server_module) -> None:
    url = gateways["keys"]
    for _ in range(3):
        assert "up to standard, not critical" in refusal(url, INHERITING_KEY, model, "critical")["message"]
    assert complete(url, CRITICAL_KEY, model, "critical") == "length"  # the only critical arrival of this fleet
    # (no sheddable request expects an answer here: one is shed with 429 whenever the fleet looks saturated)
    assert "(a request without it is standard); send sheddable," in refusal(url, BATCH_KEY, model, None)["message"]
    # the refused claims were made first: had they counted, the flush that shows the granted one would show them too
    deadline = time.monotonic() + 10
    while not (windows := asyncio.run(read_class_windows(redis_server_module.url, FLEET, 60.0))) or \
            windows[C].arrivals == 0:
        assert time.monotonic() < deadline, f"no critical arrival counted: {windows}"
        time.sleep(0.2)
    assert windows[C].arrivals == 1


def test_max_class_standard_without_keys_refuses_critical_to_every_client(gateways: dict[str, str],
                                                                          model: str) -> None:
    url = gateways["open"]
    body = refusal(url, "unused", model, "critical")
    assert body["message"].startswith("this gateway (--max-class standard) accepts x-kvfleet-priority up to standard")
    assert complete(url, "unused", model, "standard") == "length"
    assert complete(url, "unused", model, None) == "length"


def test_the_default_gateway_still_takes_critical_from_anyone(gateways: dict[str, str], model: str) -> None:
    assert complete(gateways["default"], "unused", model, "critical") == "length"
