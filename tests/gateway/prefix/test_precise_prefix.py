"""Precise prefix routing: two gateway replicas, each following both engines' KV events and tokenizing prompts as the
engines do (--tokenizer), send a tenant to the engine that holds its system prompt's blocks (even when neither
replica ever routed that tenant), and stop once that engine reports the blocks evicted: with the weighted scorer
and with prefix affinity."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import start_engine_servers, start_gateway, stop_process
from tests.support.gateways import gateway_metric, index_blocks, wait_until_routable
from tests.support.kv_event_stream import EventStream

# ~40 blocks of 16 tokens each: a few unrelated prompts evict a tenant's ~14-block system prompt
ENGINE = ("--kv-cache-memory", "480KiB", "--max-model-len", "512", "--max-num-seqs", "4")
SYSTEM = ("You are the support assistant of the {} bakery. Answer politely, mention the daily special when it "
          "fits, and never promise deliveries after six in the evening. ") * 3


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    started = start_engine_servers(tiny_model_dir, ENGINE, ENGINE)
    yield [url for _, url in started]
    for proc, _ in started:
        stop_process(proc)


# estimated-ttft is left out: after the eviction it sent some of the tenant's requests back to the former holder in
# 3 of 5 runs (noisy prefill rates of the tiny model outweigh the cached share); issue 15's next slice.
@pytest.fixture(scope="module", params=["kvfleet", "prefix-affinity"])
def gateways(request, engines, tiny_model_dir, redis_server_module):
    started = []
    try:
        for _ in range(2):
            proc, url = start_gateway(*(arg for e in engines for arg in ("--engine", e)), "--tokenizer",
                                      str(tiny_model_dir), "--redis-url", redis_server_module.url,
                                      "--routing", request.param)
            started.append(proc)
            wait_until_routable(url, len(engines))
        # the engines outlive each strategy's gateways: each strategy's run has its own tenant
        yield [p.url for p in started], SYSTEM.replace("{}", f"Harbor Lane ({request.param})")
    finally:
        for proc in started:
            stop_process(proc)


def chat(url: str, system: str, question: str) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 2}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def served_by(gateways: list[str], system: str, n: int) -> list[str]:
    """n requests of the tenant, alternating between the replicas: the engine that served each."""
    return [chat(gateways[i % 2], system, f"Question {i}: do you bake rye on Sundays?").headers["x-kvfleet-engine"]
            for i in range(n)]


def seed(engine: str, stream: EventStream, system: str) -> set[int]:
    """The tenant's prompt straight to one engine (no gateway sees it); its blocks' names, once reported stored."""
    already = len(stream.stored())
    chat(engine, system, "Hello!")
    stored = stream.wait_for(lambda s: s.stored()[already:])
    return {name for event in stored for name in event.block_hashes}


def test_both_replicas_follow_the_tenants_blocks_and_let_go_once_evicted(engines, gateways) -> None:
    gateways, system = gateways
    holder, other = engines
    streams = {url: EventStream(url) for url in engines}
    try:
        tenant_blocks = seed(holder, streams[holder], system)
        for gateway in gateways:  # both replicas hear of the blocks from the engine, not from their own routing
            deadline = time.monotonic() + 10
            while index_blocks(gateway, holder) == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert index_blocks(gateway, holder) > 0
        assert served_by(gateways, system, 6) == [holder] * 6
        for gateway in gateways:
            assert gateway_metric(gateway, "kvfleet_gateway_routing_decisions_total", 'reason="prefix_precise"') >= 3

        for i in range(6):  # unrelated prompts sent to the holder directly evict the tenant's blocks
            httpx.post(f"{holder}/v1/completions", json={"prompt": list(range(3000 + 150 * i, 3140 + 150 * i)),
                                                         "max_tokens": 2}, timeout=60).raise_for_status()
        streams[holder].wait_for(lambda s: tenant_blocks <= s.removed())
        seed(other, streams[other], system)
        time.sleep(3.5)  # past the replicas' memory of their own recent dispatches
        assert served_by(gateways, system, 6) == [other] * 6
    finally:
        for stream in streams.values():
            stream.close()
