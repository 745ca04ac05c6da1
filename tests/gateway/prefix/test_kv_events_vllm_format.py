"""KV events in vLLM's wire format, both ways. A kvfleet engine with --kv-events-zmq-port publishes its prefix
cache's blocks as a vLLM pod does (ZMQ frames `[topic, seq, msgpack batch]`, a replay socket, /kv_event_sources);
a gateway in front of engines that publish only that format builds its index from it and routes by it; vllm-router's
kv_aware policy, in front of kvfleet engines, subscribes and sends a tenant to the engine that holds its prefix. The
gateway's decoder takes vLLM's msgspec layouts (tagged maps, older tagged arrays) and survives hostile frames."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import aiohttp
import httpx
import msgpack
import pytest

from kvfleet.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventError
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix.events_zmq import ZmqEventSubscriber, decode_vllm_batch, parse_sources
from kvfleet.gateway.prefix.kv_index import KVIndex, chain_keys
from tests.conftest import free_port, start_engine_servers, start_gateway, stop_process
from tests.support.gateways import index_blocks, wait_until_routable
from tests.support.zmq_kv_events import END_SEQ, FakeVllmPod, LiveFrames, replay

BLOCK = 16
ENGINE = ("--kv-cache-memory", "480KiB", "--max-model-len", "512", "--max-num-seqs", "4",
          "--no-kv-events-sse", "--kv-events-zmq-port", "0")
STORED_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name"]
VLLM_ROUTER = Path(os.environ.get("KVFLEET_BENCH_VENVS", Path.home() / ".cache" / "kvfleet-bench" / "venvs")
                   ) / "vllm-router" / "bin" / "vllm-router"


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    started = start_engine_servers(tiny_model_dir, ENGINE, ENGINE)
    yield [url for _, url in started]
    for proc, _ in started:
        stop_process(proc)


def source(engine: str) -> dict:
    return httpx.get(engine + "/kv_event_sources", timeout=5).json()["0"]


def complete(url: str, token_ids: list[int]) -> None:
    httpx.post(f"{url}/v1/completions", json={"prompt": token_ids, "max_tokens": 2}, timeout=60).raise_for_status()


def chat(url: str, system: str, question: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 2, **extra}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def test_an_engine_publishes_vllms_frames_and_replays_them(engines) -> None:
    engine = engines[0]
    found = source(engine)
    assert found["publisher"] == "zmq" and found["enable_kv_cache_events"] and found["topic"] == ""
    assert found["endpoint"].startswith("tcp://127.0.0.1:") and found["replay_endpoint"].startswith("tcp://127.0.0.1:")
    info = httpx.get(engine + "/get_server_info", timeout=5).json()
    assert info["kv_block_size"] == BLOCK and info["model_id"] and info["instance_id"]
    assert httpx.get(engine + "/kv_events", timeout=5).status_code == 404, "--no-kv-events-sse: no SSE stream"

    live = LiveFrames(found["endpoint"])
    try:
        tokens = list(range(1000, 1070))
        complete(engine, tokens)
        batch = live.wait_for(lambda v: [(s, b) for s, b in v.batches() for e in b[1]
                                         if e["type"] == "BlockStored" and e["token_ids"][:BLOCK] == tokens[:BLOCK]])
        seq, (ts, events, rank) = batch[0]
        event = next(e for e in events if e["type"] == "BlockStored")
        assert list(event) == STORED_FIELDS, "msgspec's field order, every field without a default present"
        assert event["parent_block_hash"] is None and event["block_size"] == BLOCK and event["medium"] == "GPU"
        assert event["token_ids"] == tokens[:len(event["block_hashes"]) * BLOCK] and len(event["block_hashes"]) == 4
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        assert all(len(f) == 3 and f[0] == b"" and len(f[1]) == 8 for f in live.frames)
        seqs = [s for s, _ in live.batches()]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "numbered without gaps"

        replayed = replay(found["replay_endpoint"], 0)
        assert replayed[-1] == [b"", b"", END_SEQ, b""]
        assert [int.from_bytes(f[2], "big") for f in replayed[:-1]] == list(range(len(replayed) - 1))
        first = msgpack.unpackb(replayed[0][3])
        assert first[1][0] == {"type": "AllBlocksCleared"}, "the first batch restates the cache"
        live_frames = {int.from_bytes(f[1], "big"): f[2] for f in live.frames}
        assert replayed[seq][3] == live_frames[seq], "a replay sends the bytes that were published"
        assert [f[2] for f in replay(found["replay_endpoint"], seq)[:-1]] == [r[2] for r in replayed[seq:-1]]
    finally:
        live.close()


def test_render_answers_the_token_ids_the_engine_runs(engines) -> None:
    engine = engines[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = httpx.post(engine + "/v1/chat/completions/render", json={"messages": messages}, timeout=30).json()
    served = chat(engine, "Be brief.", "Hello there").json()
    assert len(rendered["token_ids"]) == served["usage"]["prompt_tokens"] > 0
    listed = httpx.post(engine + "/v1/completions/render", json={"prompt": "Hello there"}, timeout=30).json()
    completed = httpx.post(engine + "/v1/completions", json={"prompt": listed[0]["token_ids"], "max_tokens": 1},
                           timeout=30).json()
    plain = httpx.post(engine + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 1}, timeout=30).json()
    assert len(listed) == 1 and completed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] > 0


def following(gateway: str, engine: str) -> bool:
    """Whether the gateway's index follows the engine's KV events (it counts the engine's blocks from then on)."""
    return any(line.startswith("kvfleet_gateway_kv_index_blocks{") and f'endpoint="{engine}"' in line
               for line in httpx.get(f"{gateway}/metrics").text.splitlines())


SYSTEM = ("You are the support assistant of the Harbor Lane bakery. Answer politely, mention the daily "
          "special when it fits, and never promise deliveries after six in the evening. ") * 3


def test_a_gateway_builds_its_index_from_engines_that_publish_only_vllms_format(engines, tiny_model_dir,
                                                                                 redis_server_module) -> None:
    holder, other = engines
    proc, gateway = start_gateway(*(arg for e in engines for arg in ("--engine", e)), "--tokenizer",
                                  str(tiny_model_dir), "--redis-url", redis_server_module.url)
    try:
        wait_until_routable(gateway, len(engines))
        # the follower finds no /kv_events, asks /kv_event_sources and subscribes (replaying the pod's buffer)
        deadline = time.monotonic() + 30
        while not following(gateway, holder) and time.monotonic() < deadline:
            time.sleep(0.05)
        before = index_blocks(gateway, holder)
        chat(holder, SYSTEM, "Hello!")  # straight to one engine: the gateway hears of it only from its events
        deadline = time.monotonic() + 10
        while index_blocks(gateway, holder) <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert index_blocks(gateway, holder) > before
        served = [chat(gateway, SYSTEM, f"Question {i}: rye on Sundays?").headers["x-kvfleet-engine"]
                  for i in range(6)]
        assert served == [holder] * 6
    finally:
        stop_process(proc)


# --- the decoder and the subscriber against vLLM's layouts and hostile input --------------------------------------

STORED_MAP = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_batches_laid_out_as_vllms_msgspec_structs_decode() -> None:
    # vLLM >= 0.11: KVEventBatch is array_like ([ts, events, data_parallel_rank]), events are tagged maps; a
    # msgspec encoder writes a float as float64 and the struct's fields in declaration order.
    payload = msgpack.packb([1700000000.5, [STORED_MAP, {"type": "BlockRemoved", "block_hashes": [12],
                                                         "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0])
    assert payload[:2] == b"\x93\xcb", "a 3-array whose first item is a float64, as msgspec writes it"
    ts, events = decode_vllm_batch(payload)
    assert ts == 1700000000.5
    assert events == (BlockStored((11, 12), None, tuple(range(32)), 16), BlockRemoved((12,)), AllBlocksCleared())
    # older vLLM: tagged arrays (tag first, fields in order), a 2-item batch, 32-byte digests as block hashes
    digest = bytes(range(32))
    older = msgpack.packb([1.0, [["BlockStored", [digest], None, list(range(16)), 16, None, "GPU"],
                                 ["BlockRemoved", [digest], "GPU"], ["AllBlocksCleared"]]], use_bin_type=True)
    _, events = decode_vllm_batch(older)
    assert events[0] == BlockStored((int.from_bytes(digest, "big"),), None, tuple(range(16)), 16)
    assert events[1] == BlockRemoved((int.from_bytes(digest, "big"),)) and events[2] == AllBlocksCleared()
    # newer fields (group_idx, extra_keys, event_version) are ignored; CPU-tier and LoRA blocks are not GPU prefixes
    newer = dict(STORED_MAP, event_version=2, group_idx=0, extra_keys=[None, None], locality="LOCAL")
    cpu, lora = dict(STORED_MAP, medium="CPU"), dict(STORED_MAP, lora_id=3, lora_name="sql")
    assert decode_vllm_batch(msgpack.packb([1.0, [newer, cpu, lora], 0]))[1] == (
        BlockStored((11, 12), None, tuple(range(32)), 16),)


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x93", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", msgpack.packb("batch"),
    msgpack.packb([1.0]), msgpack.packb(["now", []]), msgpack.packb([1.0, "events"]), msgpack.packb([1.0, [1]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None,
                          "token_ids": list(range(16)), "block_size": 16}]]),
    msgpack.packb([1.0, [dict(STORED_MAP, token_ids=list(range(31)))]]),
    msgpack.packb([1.0, [dict(STORED_MAP, block_size=1 << 40)]]),
    msgpack.packb([1.0, [{"type": "Mystery"}]]), msgpack.packb([1.0, [{1: 2}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["0x1f"]}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [0] * 70_000}]]),
    msgpack.packb([1.0, [{"type": "AllBlocksCleared"}] * 70_000]),
    msgpack.packb([msgpack.ExtType(1, b"x"), []]),
    b"\x92\xcb" + b"\x00" * 8 + b"\xdc\xff\xff",  # an array that claims 65,535 items and has none
], ids=lambda p: p[:12].hex())
def test_hostile_batches_are_refused_with_a_reason(payload: bytes) -> None:
    with pytest.raises(KVEventError):
        decode_vllm_batch(payload)


def test_sources_in_each_shape_vllm_has_answered_name_a_dialable_endpoint() -> None:
    entry = {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://0.0.0.0:5558", "topic": "kv"}
    for body in ({"0": entry}, [dict(entry, data_parallel_rank=0)], {"sources": [entry]}):
        found = parse_sources(body, "http://10.0.0.7:8000")
        assert found is not None and found.endpoint == "tcp://10.0.0.7:5557"
        assert found.replay_endpoint == "tcp://10.0.0.7:5558" and found.topic == b"kv"
    for hostile in ({}, [], "x", {"0": "x"}, {"0": {"endpoint": "ipc:///tmp/x"}}, {"0": {"endpoint": 5}},
                    {"0": {"endpoint": "tcp://h:x"}}, {"9" * 5000: entry},
                    {"0": dict(entry, enable_kv_cache_events=False)}, {"0": dict(entry, topic=["x"])}):
        assert parse_sources(hostile, "http://10.0.0.7:8000") is None


def stored(seq_tokens: int, parent: int | None, name: int) -> dict:
    return dict(STORED_MAP, block_hashes=[name], parent_block_hash=parent,
                token_ids=list(range(seq_tokens, seq_tokens + 16)))


def held(index: KVIndex, url: str, tokens: list[int]) -> int:
    return index.matched_blocks({16: chain_keys(tokens, 16)}).get(url, 0)


def test_the_subscriber_lets_go_of_a_pod_whose_scrapes_fail_within_seconds() -> None:
    """A pod that dies sends nothing more: its stream goes quiet, as an idle pod's does. The gateway's scrapes tell
    them apart; once they fail the subscription ends (its caller forgets the pod's blocks) instead of holding them
    until the next rediscovery, 30 s on."""
    pod, index = FakeVllmPod(), KVIndex()
    alive = {"now": True}

    async def scenario() -> float:
        subscriber = ZmqEventSubscriber(index, GatewayMetrics())
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(subscriber.follow(session, pod.url, {}, lambda: alive["now"]))
            try:
                await until(lambda: index.engines() == [pod.url])
                await asyncio.to_thread(pod.wait_subscribed)
                pod.send(0, msgpack.packb([1.0, [stored(100, None, 1)], 0]))
                await until(lambda: held(index, pod.url, list(range(100, 116))) == 1)
                await asyncio.sleep(1.5)
                assert not task.done(), "a quiet pod that answers its scrapes is followed on"
                alive["now"] = False
                began = time.monotonic()
                assert await asyncio.wait_for(task, 5.0) is True
                return time.monotonic() - began
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    try:
        assert asyncio.run(scenario()) < 2.5
    finally:
        pod.close()


def test_the_subscriber_survives_garbage_fills_gaps_once_and_notices_a_restart() -> None:
    pod, index = FakeVllmPod(), KVIndex()
    first, second = list(range(100, 116)), list(range(100, 132))

    async def scenario() -> None:
        subscriber = ZmqEventSubscriber(index, GatewayMetrics())
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(subscriber.follow(session, pod.url, {}))
            try:
                await until(lambda: index.engines() == [pod.url])
                await asyncio.to_thread(pod.wait_subscribed)
                for frames in ([b"garbage"], [b"", b"\x00" * 3, b"x"], [b"", (0).to_bytes(8, "big"), b"\xc1"]):
                    pod.send_frames(frames)
                pod.send(0, msgpack.packb([1.0, [stored(100, None, 1)], 0]))
                await until(lambda: held(index, pod.url, first) == 1)
                pod.send(1, msgpack.packb([1.0, [stored(116, 1, 2)], 0]), live=False)  # only a replay has it
                pod.send(2, msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}],
                                           0]))
                await until(lambda: held(index, pod.url, second) == 2)
                pod.buffer.clear()  # a bounded buffer: what was applied is gone from it
                pod.replay_delay = 0.5  # a live batch published while a replay is served arrives twice
                pod.send(3, msgpack.packb([1.0, [stored(132, 2, 3)], 0]), live=False)
                pod.send(4, msgpack.packb([1.0, [stored(148, 3, 4)], 0]))
                await asyncio.sleep(0.2)
                pod.send(5, msgpack.packb([1.0, [stored(164, 4, 5)], 0]))
                await asyncio.sleep(0.6)
                pod.send(6, msgpack.packb([1.0, [stored(180, 5, 6)], 0]))
                await until(lambda: held(index, pod.url, list(range(100, 196))) == 6)
                pod.buffer.clear()  # the pod restarts: its numbering starts again, its cache is empty
                pod.send(0, msgpack.packb([1.0, [{"type": "AllBlocksCleared"}, stored(500, None, 7)], 0]))
                await until(lambda: held(index, pod.url, first) == 0 and held(index, pod.url, list(range(500, 516))))
                assert not task.done(), "nothing a pod sent ended the subscription"
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                subscriber.close()

    try:
        asyncio.run(scenario())
    finally:
        pod.close()


async def until(what, timeout: float = 5.0) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.02)


# --- kvfleet engines -> vllm-router ------------------------------------------------------------------------------

def prompt_tokens(engine: str) -> float:
    for line in httpx.get(engine + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvfleet_prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.skipif(not VLLM_ROUTER.exists(), reason=f"vllm-router is not installed at {VLLM_ROUTER} "
                    "(python -m bench.peers install vllm-router)")
def test_vllm_routers_kv_aware_policy_follows_kvfleet_engines_events(engines, tmp_path) -> None:
    port, metrics_port = free_port(), free_port()
    log = open(tmp_path / "vllm-router.log", "w")  # noqa: SIM115 - closed below
    router = subprocess.Popen([str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                               *engines, "--policy", "kv_aware", "--prometheus-host", "127.0.0.1",
                               "--prometheus-port", str(metrics_port), "--log-level", "debug"],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        system = "You answer for the Quayside ferry office: timetables, fares and lost property. " * 4
        holder, other = engines[1], engines[0]  # the second worker: a tie would go elsewhere
        chat(holder, system, "Hello!")
        time.sleep(1.0)  # the router's subscriber receives the blocks
        before = {e: prompt_tokens(e) for e in engines}
        for i in range(4):
            chat(url, system, f"Question {i}: is there a late boat on Fridays?")
        assert prompt_tokens(other) == before[other], "the router sent the tenant away from its prefix"
        assert prompt_tokens(holder) > before[holder]
        lookups = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert 'vllm_router_kv_placement_lookups_total{result="hit"}' in lookups
    finally:
        router.terminate()
        router.wait(10)
        log.close()
