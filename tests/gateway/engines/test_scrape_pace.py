"""How often the gateway reads an engine's /metrics: once a second while it has sent the engine nothing for a while
and nothing waits in its queue (an idle gateway in front of vLLM engines spent most of its CPU on their scrapes), at
once when a request is sent, and at its busy pace while requests are open there. A real engine behind a real
`kvfleet gateway` process on its default data plane; the gateway's own gauges (what an operator's dashboard reads)
say the pace and the age of its last reading."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.engines.pool import QUIET_AFTER_S
from kvfleet.gateway.engines.scraper import QUIET_SCRAPE_INTERVAL_S
from tests.conftest import start_gateway, stop_process
from tests.support.gateways import gateway_metric, wait_until_routable
from tests.support.polling import until

BASE_INTERVAL_S = GatewayConfig().scrape_interval_s  # the default pace, kept while the fleet is busy


@pytest.fixture
def gateway(tiny_server):
    proc, url = start_gateway("--engine", tiny_server)
    wait_until_routable(url)
    yield url
    stop_process(proc)


def served(engine: str) -> str:
    return httpx.get(f"{engine}/v1/models", timeout=10).json()["data"][0]["id"]


def pace(url: str, engine: str) -> float:
    return gateway_metric(url, "kvfleet_gateway_scrape_interval_seconds", f'endpoint="{engine}"')


def age(url: str, engine: str) -> float:
    return gateway_metric(url, "kvfleet_gateway_scrape_age_seconds", f'endpoint="{engine}"')


def test_a_quiet_engine_is_read_once_a_second_and_at_once_when_a_request_goes_to_it(gateway, tiny_server) -> None:
    until(lambda: pace(gateway, tiny_server) == QUIET_SCRAPE_INTERVAL_S, "the idle gateway never slowed its reads",
          timeout=QUIET_AFTER_S + 10)
    ages = []
    for _ in range(30):  # over 1.5 s: readings as old as most of a second, none older than the slow pace allows
        ages.append(age(gateway, tiny_server))
        time.sleep(0.05)
    assert max(ages) > 0.5 and max(ages) < 2.5 * QUIET_SCRAPE_INTERVAL_S, ages
    answered = httpx.post(f"{gateway}/v1/completions", timeout=60,
                          json={"model": served(tiny_server), "prompt": "Hello", "max_tokens": 2})
    assert answered.status_code == 200, answered.text
    # the request woke a reading at once, and the engine is read at the busy pace for a while after
    assert pace(gateway, tiny_server) == BASE_INTERVAL_S
    assert age(gateway, tiny_server) < 0.5


def test_an_engine_the_gateway_keeps_sending_to_is_read_at_the_busy_pace_all_along(gateway, tiny_server) -> None:
    stop, answers, model = threading.Event(), [], served(tiny_server)

    def send() -> None:
        while not stop.is_set():
            answers.append(httpx.post(f"{gateway}/v1/completions", timeout=60, json={
                "model": model, "prompt": "Count on:", "max_tokens": 64, "ignore_eos": True}).status_code)
    sender = threading.Thread(target=send)
    sender.start()
    ages, paces = [], []
    try:
        until(lambda: answers, "no answer came")
        deadline = time.monotonic() + QUIET_AFTER_S + 1.5  # past the time an engine sent nothing turns quiet
        while time.monotonic() < deadline:
            ages.append(age(gateway, tiny_server))
            paces.append(pace(gateway, tiny_server))
            time.sleep(0.1)
    finally:
        stop.set()
        sender.join()
    assert set(answers) == {200}
    assert set(paces) == {BASE_INTERVAL_S}, paces
    assert max(ages) < 0.5, ages
