"""Sleep mode (`--enable-sleep-mode`, vLLM's routes): an idle engine releases its KV cache on POST /sleep and takes it
back on POST /wake_up, answering as before; asleep it is alive (/health) but not ready (/ready 503, so Kubernetes
and the gateway send it nothing) and a request that reaches it gets a 503 that says so. One real engine process; the
released memory is read from the process's resident set."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_engine, start_engine_server, stop_process

TOKEN = "sleep-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KV_MIB = 192
BODY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def sleepy(tiny_model_dir: Path):
    proc, url = start_engine_server(tiny_model_dir, "--enable-sleep-mode", "--kv-cache-memory", f"{KV_MIB}MiB",
                                    "--api-key", TOKEN)
    yield proc, url
    stop_process(proc)


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=60)


def streaming(url: str, max_tokens: int) -> tuple[threading.Thread, list]:
    """A streamed completion of max_tokens running in a thread, once its first token came; the finish reasons of
    its chunks gather in the list."""
    started, finish = threading.Event(), []

    def stream() -> None:
        body = {**BODY, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])
                    started.set()

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(30)
    return worker, finish


def test_an_idle_engine_sleeps_releasing_its_kv_cache_and_wakes_answering_as_before(sleepy) -> None:
    proc, url = sleepy
    before = complete(url).json()["choices"][0]["text"]
    awake_mib = resident_mib(proc.pid)
    answer = httpx.post(f"{url}/sleep", params={"level": "1"}, headers=AUTH, timeout=30)
    assert answer.status_code == 200 and answer.json() == {"is_sleeping": True, "sleep_pending": False}
    assert awake_mib - resident_mib(proc.pid) >= 0.8 * KV_MIB  # the cache's memory went back to the system
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True, "sleep_pending": False}
    assert httpx.get(f"{url}/health").status_code == 200
    ready = httpx.get(f"{url}/ready")
    assert (ready.status_code, ready.json()["status"]) == (503, "sleeping")
    refused = complete(url)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "engine_asleep" and "/wake_up" in refused.json()["error"]["message"]
    assert httpx.post(f"{url}/sleep", headers=AUTH).status_code == 200  # again: nothing changes
    woke = httpx.post(f"{url}/wake_up", headers=AUTH, timeout=30)
    assert woke.status_code == 200 and woke.json() == {"is_sleeping": False, "sleep_pending": False}
    assert httpx.get(f"{url}/ready").status_code == 200
    assert complete(url).json()["choices"][0]["text"] == before
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvfleet_requests_rejected_total{reason="asleep"} 1.0' in metrics


def test_an_engine_busy_with_a_request_refuses_to_sleep_and_the_request_runs_on(sleepy) -> None:
    _, url = sleepy
    worker, finish = streaming(url, 60)
    refused = httpx.post(f"{url}/sleep", headers=AUTH, timeout=30)
    worker.join(60)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "engine_busy"
    assert "drain" in refused.json()["error"]["message"]
    assert finish[-1] == "length"  # it ran to its end
    assert httpx.get(f"{url}/is_sleeping").json()["is_sleeping"] is False


def test_a_drained_sleep_leaves_the_service_at_once_and_sleeps_when_the_last_request_ends(sleepy) -> None:
    _, url = sleepy
    worker, finish = streaming(url, 80)
    pending = httpx.post(f"{url}/sleep", params={"drain": "true"}, headers=AUTH, timeout=30)
    assert pending.status_code == 202 and pending.json() == {"is_sleeping": False, "sleep_pending": True}
    assert httpx.get(f"{url}/ready").json()["status"] == "sleeping"  # out of the Service while it finishes
    worker.join(60)
    assert finish[-1] == "length"
    for _ in range(100):
        if httpx.get(f"{url}/is_sleeping").json()["is_sleeping"]:
            break
        threading.Event().wait(0.05)
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True, "sleep_pending": False}
    assert httpx.post(f"{url}/wake_up", headers=AUTH, timeout=30).status_code == 200
    assert complete(url).status_code == 200


@pytest.mark.parametrize(("path", "params", "param"), [
    ("/sleep", {"level": "2"}, "level"), ("/sleep", {"level": "x" * 10_000}, "level"),
    ("/sleep", [("level", "1"), ("level", "1")], "level"), ("/wake_up", {"tags": "gpu"}, "tags"),
    ("/sleep", {"drain": "yes"}, "drain")])
def test_a_level_or_tag_the_engine_does_not_offer_is_a_400_naming_it(sleepy, path, params, param) -> None:
    _, url = sleepy
    answer = httpx.post(f"{url}{path}", params=params, headers=AUTH)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert len(answer.text) < 1000
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False, "sleep_pending": False}


def test_sleep_and_wake_need_the_engine_token(sleepy) -> None:
    _, url = sleepy
    for path in ("/sleep", "/wake_up"):
        assert httpx.post(f"{url}{path}").status_code == 401
    assert httpx.get(f"{url}/is_sleeping").json()["is_sleeping"] is False


def test_without_sleep_mode_the_routes_say_how_to_turn_it_on(tiny_server: str) -> None:
    answer = httpx.post(f"{tiny_server}/sleep")
    assert answer.status_code == 404 and "--enable-sleep-mode" in answer.json()["error"]["message"]
    assert httpx.get(f"{tiny_server}/ready").status_code == 200


def test_the_engine_forgets_its_prefix_cache_asleep_and_its_kv_event_subscribers_learn_it_at_once(
        tiny_model_dir: Path) -> None:
    import asyncio

    from kvfleet.engine.async_engine import AsyncEngine
    from kvfleet.engine.kv_event_hub import KVEventHub
    from kvfleet.engine.sampling_params import SamplingParams

    engine = make_engine(tiny_model_dir, enable_sleep_mode=True)
    engine.block_manager.events = []
    hub = KVEventHub()
    front = AsyncEngine(engine, kv_events=hub)

    async def scenario() -> None:
        async for _ in front.generate([5] * 64, SamplingParams(max_tokens=2)):
            pass
        assert hub.num_blocks > 0 and engine.block_manager.cached_blocks
        assert await front.sleep() is True
        assert hub.num_blocks == 0  # published with the sleep, not at some later step
        assert engine.backend.kv_cache is None and not engine.block_manager.cached_blocks
        await front.wake_up()
        assert engine.backend.kv_cache is not None and engine.stats().kv_blocks_free == engine.capacity.num_blocks

    try:
        asyncio.run(scenario())
    finally:
        front.shutdown()
    with pytest.raises(Exception, match="stopped"):  # a call after the engine thread ended fails, never hangs
        asyncio.run(front.wake_up())
