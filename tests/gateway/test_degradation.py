"""The degradation ladder under a saturated fleet (issue 19, item 3): with --degrade-max-tokens standard=3, a standard
request that arrives while the one engine is saturated is served with at most 3 output tokens and says so
(x-kvfleet-degraded: max_tokens=3, counted in kvfleet_gateway_degraded_total); a sheddable one reaches the last
rung and is shed (429); once the fleet has room the same request is served as asked. Both data planes (the Python
proxy, and Envoy with the picker), a real engine that runs one sequence at a time."""

from __future__ import annotations

import threading

import httpx
import pytest

from kvfleet.fleet.headers import DEGRADED, PRIORITY
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.degradation import cap_output, output_cap
from tests.conftest import one_sequence_engine_fixtures, start_gateway, stop_process
from tests.support.engines import saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

engine, model = one_sequence_engine_fixtures()


@pytest.mark.parametrize(("path", "body", "capped", "after"), [
    ("/v1/completions", {"max_tokens": 100}, True, {"max_tokens": 8}),
    ("/v1/completions", {"max_tokens": 5}, False, {"max_tokens": 5}),
    ("/v1/completions", {}, True, {"max_tokens": 8}),  # OpenAI's default is 16
    ("/v1/chat/completions", {}, True, {"max_tokens": 8}),  # what the context leaves
    ("/v1/chat/completions", {"max_completion_tokens": 50}, True, {"max_completion_tokens": 8, "max_tokens": 8}),
    ("/v1/chat/completions", {"max_tokens": 4}, False, {"max_tokens": 4}),
])
def test_the_cap_lowers_only_what_asks_for_more(path: str, body: dict, capped: bool, after: dict) -> None:
    assert cap_output(path, body, 8) is capped and body == after


def test_a_cap_applies_only_while_saturated_and_to_the_classes_given() -> None:
    caps = {Priority.STANDARD: 256}
    assert output_cap(Priority.STANDARD, True, caps) == 256
    assert output_cap(Priority.STANDARD, False, caps) is None and output_cap(Priority.CRITICAL, True, caps) is None


@pytest.fixture(scope="module", params=["python", "envoy"])
def gateway(request, engine: str):
    proc, url = start_gateway("--engine", engine, "--data-plane", request.param, "--saturation-queue", "1",
                              "--degrade-max-tokens", "standard=3", timeout=90.0)
    wait_until_routable(url)
    yield url
    stop_process(proc)


def complete(gateway: str, model: str, priority: str, out: dict) -> None:
    out[priority] = httpx.post(f"{gateway}/v1/completions", timeout=120, headers={PRIORITY: priority}, json={
        "model": model, "prompt": "tell me more", "max_tokens": 12, "ignore_eos": True})


def gauge(gateway: str, prefix: str) -> float:
    for line in httpx.get(f"{gateway}/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[1])
    return 0.0


def degraded_count(gateway: str) -> float:
    return gauge(gateway, 'kvfleet_gateway_degraded_total{priority="standard",step="max_tokens"}')


def test_a_saturated_fleet_caps_standard_output_sheds_sheddable_and_says_so(gateway: str, engine: str,
                                                                            model: str) -> None:
    before, out = degraded_count(gateway), {}
    with saturated(engine, model, (gateway,)):
        waiter = threading.Thread(target=complete, args=(gateway, model, "standard", out))
        waiter.start()
        complete(gateway, model, "sheddable", out)
        until(lambda: gauge(gateway, 'kvfleet_gateway_queue_depth{priority="standard"}') >= 1,
              "the standard request never waited in the fleet queue")
    waiter.join()
    assert out["sheddable"].status_code == 429  # the last rung
    capped = out["standard"]
    assert capped.status_code == 200, capped.text
    assert capped.headers[DEGRADED] == "max_tokens=3"
    assert capped.json()["usage"]["completion_tokens"] == 3
    assert capped.json()["choices"][0]["finish_reason"] == "length"
    assert degraded_count(gateway) == before + 1
    # the holders are gone: once the gateway's view has the engine's room again (its next scrape after the engine
    # drops the disconnected holders), the same request is served as asked
    until(lambda: gauge(gateway, 'kvfleet_gateway_endpoints{state="available"}') >= 1,
          "the gateway never saw the engine with room again")
    with_room: dict = {}
    complete(gateway, model, "standard", with_room)
    served = with_room["standard"]
    assert served.json()["usage"]["completion_tokens"] == 12 and DEGRADED not in served.headers
