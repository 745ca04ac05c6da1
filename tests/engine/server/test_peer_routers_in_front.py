"""The routers teams already run, from PyPI, in front of two kvfleet engines: sglang-router and vllm-router, each with
its prefix-aware policy (cache_aware) and its load policy (power_of_two). Every request through them is served (chat,
streamed chat, completions with echo) through the official `openai` client; sglang-router registers the engines
under their served model name (not "unknown"); everything the routers ask the engines (discovery, /tokenize, render,
loads, generation) is answered below 400, seen by a recording proxy in front of each engine; and the engines log no
warning about the fields the routers add to every request.

The routers live in their own virtual environments (`python -m bench.peers install sglang-router vllm-router`, which
the README's test command runs); where they are missing this module is skipped, except under CI, where it fails."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from openai import OpenAI

from bench.peers import PEERS, start
from tests.conftest import process_output, start_engine_servers, stop_process
from tests.support.blackhole_proxy import RecordingProxy

MODEL = "tiny"
ROUTERS = ("sglang-router", "vllm-router")
MISSING = [name for name in ROUTERS if not PEERS[name].installed()]
if MISSING and os.environ.get("CI"):
    raise RuntimeError(f"{', '.join(MISSING)} not installed: run `python -m bench.peers install {' '.join(MISSING)}`")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"{MISSING} not installed (python -m bench.peers install)")


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    engine = ("--served-model-name", MODEL, "--max-num-seqs", "4")
    started = start_engine_servers(tiny_model_dir, engine, engine)
    yield started
    for proc, _ in started:
        stop_process(proc)


@pytest.fixture
def proxies(engines):
    """A fresh recording proxy in front of each engine, so each test sees only its own router's exchanges."""
    recorders = []
    for _, url in engines:
        address = urlparse(url)
        recorders.append(RecordingProxy(address.hostname, address.port).start())
    yield recorders
    for proxy in recorders:
        proxy.close()


@pytest.mark.parametrize("policy", ["cache_aware", "power_of_two"])
@pytest.mark.parametrize("router", ROUTERS)
def test_router_in_front_of_kvfleet_engines(router: str, policy: str, engines, proxies, tmp_path: Path) -> None:
    child = start(PEERS[router], [p.url for p in proxies], MODEL, tmp_path, policy=policy)
    try:
        client = OpenAI(base_url=f"{child.url}/v1", api_key="unused", max_retries=0, timeout=60)
        system = "You are a terse assistant for the kvfleet interop test. " * 8  # a shared prefix to match on
        for i in range(4):
            chat = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
            assert chat.model == MODEL and chat.choices[0].message.content
        streamed = client.chat.completions.create(model=MODEL, max_tokens=4, stream=True, messages=[
            {"role": "user", "content": "stream, please"}])
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        echoed = client.completions.create(model=MODEL, prompt="Echo this:", max_tokens=3, echo=True)
        assert echoed.choices[0].text.startswith("Echo this:")
        if router == "sglang-router":
            workers = httpx.get(f"{child.url}/workers", timeout=5).json()["workers"]
            assert [w["model_id"] for w in workers] == [MODEL, MODEL]
    finally:
        child.stop()
    exchanges = [e for proxy in proxies for e in proxy.exchanges()]
    refused = [e for e in exchanges if e[1] is None or e[1] >= 400]
    assert not refused, f"{router} asked the engines what they could not answer: {refused}"
    asked = {request.split("?")[0] for request, _ in exchanges}
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= asked
    if router == "vllm-router" and policy == "cache_aware":
        # its prefix matching asks the engines for each request's token ids: render, else /tokenize
        assert asked & {"POST /v1/chat/completions/render", "POST /v1/completions/render", "POST /tokenize"}
    if router == "sglang-router":
        assert asked & {"GET /server_info", "GET /get_server_info", "GET /model_info", "GET /get_model_info"}
    for proc, _ in engines:
        assert "ignored unknown request fields" not in process_output(proc)
