"""The gateway routes a LoRA adapter's requests by adapter affinity, as the Gateway API Inference Extension's picker
does: an engine where the adapter is active, then one with a free adapter slot. It learns which engines serve which
adapters from their /v1/models and their lora_requests_info gauge (kvfleet's or vLLM's name), counts requests per
adapter, lists adapters in /v1/models, and resolves an adapter's name to its base model's fleet. A hostile gauge
is not believed."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvfleet.fleet.load import LoraInfo, MetricsParseError, parse_engine_load
from kvfleet.gateway.engines.adapters import served_adapters
from kvfleet.gateway.routing.pick import EndpointSnapshot, RoutingContext, serving
from kvfleet.gateway.routing.scorers import LoraAffinity
from kvfleet.gateway.routing.strategies import strategy_named
from tests.conftest import start_engine_servers, start_gateway, stop_process
from tests.support.gateways import wait_until_routable
from tests.support.lora_adapters import make_adapter

LOAD = "kvfleet_kv_cache_usage 0.1\nkvfleet_num_requests_waiting 0\nkvfleet_num_requests_running 1\n"


def info_line(name: str, value: float, running: str, waiting: str = "", max_lora: str = "2") -> str:
    return (f'{name}{{max_lora="{max_lora}",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} '
            f"{value}\n")


def test_the_newest_lora_sample_is_read_under_either_name() -> None:
    text = LOAD + info_line("vllm:lora_requests_info", 1.7e9, "sql,poet", "chef") + info_line(
        "vllm:lora_requests_info", 1.6e9, "old")  # vLLM keeps every label set it ever had
    assert parse_engine_load(text).lora == LoraInfo(2, frozenset({"sql", "poet"}), frozenset({"chef"}))
    text = LOAD + info_line("kvfleet_lora_requests_info", 1.7e9, "")
    assert parse_engine_load(text).lora == LoraInfo(2, frozenset(), frozenset())
    assert parse_engine_load(LOAD).lora is None  # no adapters served


@pytest.mark.parametrize(("line", "says"), [
    (info_line("kvfleet_lora_requests_info", 1.0, "a", max_lora="many"), "no whole-number max_lora"),
    (info_line("kvfleet_lora_requests_info", 1.0, ",".join(f"a{i}" for i in range(2000))), "more than"),
    (info_line("kvfleet_lora_requests_info", 1.0, "a", max_lora="0"), "max_lora 0 is not from 1"),
])
def test_a_lora_gauge_no_engine_would_write_is_not_believed(line: str, says: str) -> None:
    with pytest.raises(MetricsParseError, match=says):
        parse_engine_load(LOAD + line)


def snapshot(url: str, running=(), waiting=(), max_loras: int = 2, sent=(), served=None, last=(),
             lora: bool = True) -> EndpointSnapshot:
    return EndpointSnapshot(url, True, 0.1, 0, 1, 0.0,
                            lora=LoraInfo(max_loras, frozenset(running), frozenset(waiting)) if lora else None,
                            adapters_sent=frozenset(sent), adapters_last=frozenset(last),
                            adapters_served=None if served is None else frozenset(served))


def test_affinity_scores_as_the_inference_extension_does() -> None:
    engines = [snapshot("active", running=["sql"]), snapshot("free", running=["poet"]),
               snapshot("waiting", running=["a", "b"], waiting=["sql"]), snapshot("full", running=["a", "b"]),
               snapshot("just-sent", running=["a", "b"], sent=["sql"]), snapshot("no-lora", lora=False),
               snapshot("not-served", served=["poet"]), snapshot("went-last", last=["sql"]),
               snapshot("went-last-but-full", running=["a", "b"], last=["sql"])]
    assert LoraAffinity().scores(engines, RoutingContext(adapter="sql")) == [1.0, 0.8, 0.6, 0.0, 1.0, 0.0, 0.0, 0.9,
                                                                             0.0]
    assert LoraAffinity().scores(engines, RoutingContext()) == [0.0] * len(engines)  # the base model's request


def test_the_kvfleet_strategy_sends_an_adapter_where_it_is_active() -> None:
    strategy = strategy_named("kvfleet")
    engines = [snapshot("a", running=["poet", "chef"]), snapshot("b", running=["sql"]), snapshot("c")]
    rng = random.Random(0)
    picks = {strategy.choose(engines, RoutingContext(adapter="sql"), rng).url for _ in range(50)}
    assert picks == {"b"}
    picks = {strategy.choose(engines, RoutingContext(adapter="new"), rng).url for _ in range(50)}
    assert "a" not in picks  # full of other adapters: a free slot elsewhere is better


def test_an_adapters_request_goes_only_to_engines_that_serve_it_or_are_not_read_yet() -> None:
    engines = [snapshot("has", served=["sql"]), snapshot("lacks", served=["poet"]), snapshot("unread")]
    assert [e.url for e in serving(engines, "sql")] == ["has", "unread"]
    assert [e.url for e in serving(engines, None)] == ["has", "lacks", "unread"]  # the base model: anywhere
    lacking = [snapshot("a", served=[]), snapshot("b", served=["poet"])]
    assert serving(lacking, "sql") == lacking  # none serves it: the engines' 404 says what they serve
    # The load-only strategies (least-request) follow the same filter: a lightly loaded engine without it loses.
    idle_without = EndpointSnapshot("idle", True, 0.0, 0, 0, 0.0, adapters_served=frozenset())
    busy_with = EndpointSnapshot("busy", True, 0.5, 3, 4, 0.0, adapters_served=frozenset({"sql"}))
    pool = serving([idle_without, busy_with], "sql")
    assert strategy_named("least-request").choose(pool, RoutingContext(adapter="sql"), random.Random(0)).url == "busy"


def test_served_adapters_are_the_entries_with_a_parent() -> None:
    body = {"data": [{"id": "base"}, {"id": "sql", "parent": "base"}, {"id": 3, "parent": "base"},
                     {"id": "x" * 300, "parent": "base"}]}
    assert served_adapters(body) == {"sql"}
    with pytest.raises(ValueError):
        served_adapters({"data": [{"id": str(i), "parent": "b"} for i in range(5000)]})


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gateway-lora")
    return {name: make_adapter(tiny_model_dir, root / name, seed=i, rank=4, std=0.2)
            for i, name in enumerate(("sql", "poet", "chef"))}


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, adapters: dict[str, Path]):
    engine = ("--max-loras", "1", "--max-num-seqs", "4", "--kv-cache-memory", "16MiB",
              "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))
    started = start_engine_servers(tiny_model_dir, engine, engine)
    yield [url for _, url in started]
    for proc, _ in started:
        stop_process(proc)


@pytest.fixture(scope="module", params=["python", "envoy"])
def fleet(request, engines: list[str]):
    """The same decisions whichever carries the bytes: the Python proxy, or Envoy with the picker (ext_proc)."""
    gateway, url = start_gateway(*(f for u in engines for f in ("--engine", u)), "--data-plane", request.param,
                                 timeout=90.0)
    yield url, engines
    stop_process(gateway)


def test_through_the_gateway_each_adapter_sticks_to_the_engine_where_it_is_active(fleet, tiny_model_dir) -> None:
    gateway, engines = fleet
    wait_until_routable(gateway, 2)
    client = OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=60)
    listed = {m.id for m in client.models.list().data}
    assert {"sql", "poet", "chef"} <= listed
    seen: dict[str, set[str]] = {"sql": set(), "poet": set()}
    for i in range(6):
        streams = []
        for name in seen:  # sql's request still runs when poet's arrives: one adapter slot each, so apart
            raw = client.completions.with_raw_response.create(
                model=name, prompt=f"request {i}", max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
                stream=True)
            seen[name].add(raw.headers["x-kvfleet-engine"])
            stream = raw.parse()
            next(iter(stream))
            streams.append(stream)
        for stream in streams:  # then idle: each returns where it went last
            for _ in stream:
                pass
    # one adapter slot each: the gateway keeps each adapter where it is active, and the two apart
    assert all(len(urls) == 1 for urls in seen.values()), seen
    assert seen["sql"] != seen["poet"]
    metrics = httpx.get(f"{gateway}/metrics").text
    counted = dict(re.findall(r'kvfleet_gateway_lora_requests_total\{adapter="(\w+)"\} ([\d.]+)', metrics))
    assert counted == {"sql": "6.0", "poet": "6.0"}
    for _ in range(50):  # a stream's count settles just after its last event reached the client
        tokens = {(a, kind): float(v) for a, kind, v in re.findall(
            r'kvfleet_gateway_lora_tokens_total\{adapter="(\w+)",kind="(\w+)"\} ([\d.]+)',
            httpx.get(f"{gateway}/metrics").text)}
        if tokens.get(("sql", "completion")) == tokens.get(("poet", "completion")) == 6 * 24:
            break
        time.sleep(0.1)
    assert tokens[("sql", "completion")] == tokens[("poet", "completion")] == 6 * 24  # as the engines counted them
    assert tokens[("sql", "prompt")] > 0 and tokens[("poet", "prompt")] > 0


def test_a_gateway_of_several_models_sends_an_adapter_to_its_base_models_fleet(engines, tiny_model_dir) -> None:
    base = str(tiny_model_dir)  # the engines' served name
    gateway, url = start_gateway("--engine", f"{base}={engines[0]}", "--engine", f"other={engines[1]}")
    try:
        wait_until_routable(url, 2)
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(100):  # the adapters are read from the engines' /v1/models once their gauge shows LoRA
            cards = {m.id: m for m in client.models.list().data}
            if "sql" in cards:
                break
            time.sleep(0.1)
        assert cards["sql"].parent in (base, "other")
        raw = client.completions.with_raw_response.create(model="sql", prompt="hi", max_tokens=2)
        assert raw.parse().model == "sql" and raw.headers["x-kvfleet-engine"] in engines
        with pytest.raises(Exception, match="does not exist"):
            client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    finally:
        stop_process(gateway)
