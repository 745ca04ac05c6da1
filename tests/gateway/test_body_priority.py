"""The gateway alone decides engine priority: a client's body `priority` is dropped unless its key may set it.

Checked by behaviour on a real engine with one batch slot (`--max-num-seqs 1`), where a waiting request with a
lower `priority` preempts the running one: a sheddable request that claims `"priority": -100` must wait for the
running standard request instead of jumping ahead of it. A key with `allow_priority=true` is the control: its
request does jump ahead, which shows the check can fail.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import start_engine_server, start_gateway, stop_process
from tests.support.gateways import wait_until_routable

PLAIN_KEY = "sk-plain-" + "p" * 20
TRUSTED_KEY = "sk-trusted-" + "t" * 20


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> str:
    proc, url = start_engine_server(tiny_model_dir, "--max-num-seqs", "1")
    yield url
    stop_process(proc)


@pytest.fixture(scope="module")
def gateways(engine: str, tmp_path_factory) -> dict[str, str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{PLAIN_KEY} name=plain\n{TRUSTED_KEY} name=trusted allow_priority=true\n")
    with_keys, with_keys_url = start_gateway("--engine", engine, "--api-keys-file", str(keys))
    open_gw, open_url = start_gateway("--engine", engine)
    for url in (with_keys_url, open_url):
        wait_until_routable(url)
    yield {"keys": with_keys_url, "open": open_url}
    stop_process(with_keys)
    stop_process(open_gw)


def running_at(engine: str) -> float:
    lines = httpx.get(f"{engine}/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith("kvfleet_num_requests_running ")))


async def jumps_ahead(gateway: str, engine: str, key: str, model: str) -> bool:
    """Whether a sheddable request with body priority -100 finishes before the long request already running."""
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
    long_done = asyncio.get_running_loop().create_future()

    async def long_request() -> None:
        stream = await client.completions.create(model=model, prompt="a", max_tokens=220, stream=True,
                                                 extra_body={"ignore_eos": True})
        started.set()
        async for _ in stream:
            pass
        long_done.set_result(time.monotonic())

    started = asyncio.Event()
    running = asyncio.create_task(long_request())
    await started.wait()
    while running_at(engine) != 1:  # until it holds the engine's only slot
        await asyncio.sleep(0.01)
    short = await client.completions.create(model=model, prompt="b", max_tokens=4,
                                            extra_headers={"x-kvfleet-priority": "sheddable"},
                                            extra_body={"priority": -100})
    short_done = time.monotonic()
    assert short.choices[0].finish_reason == "length"
    await running
    return short_done < long_done.result()


def test_a_body_priority_from_a_client_never_reaches_the_engine(gateways: dict[str, str], engine: str) -> None:
    model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]

    async def run() -> None:
        assert await jumps_ahead(gateways["keys"], engine, TRUSTED_KEY, model)  # the control: the engine honours it
        assert not await jumps_ahead(gateways["keys"], engine, PLAIN_KEY, model)
        assert not await jumps_ahead(gateways["open"], engine, "unused", model)  # without API keys: always dropped

    asyncio.run(run())
