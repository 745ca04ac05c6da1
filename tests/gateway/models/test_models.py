"""Several models behind one gateway (issue 19, item 1) and the ladder's fallback rung (item 3b): two real engines
serving two different models (SmolLM2-135M-Instruct as `smollm2`, and a random-weight tiny Llama as `tiny` that runs
one sequence at a time), one real gateway on each data plane (the Python proxy, and Envoy with the picker), real
Redis, and the official OpenAI client."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.fleet.headers import ALLOW_FALLBACK, DEGRADED, ENGINE, PRIORITY
from kvfleet.fleet.priority import Priority
from kvfleet.fleet.redis_keys import key_prefix
from kvfleet.gateway.models.routes import ModelRoute, ModelTable, fleet_name_for, routes_from_flags
from tests.conftest import start_engine_servers, start_gateway, stop_process
from tests.support.engines import saturated
from tests.support.polling import until

# ---- the routes, pure ----------------------------------------------------------------------------------------


def test_named_engines_make_one_route_per_model_with_its_aliases_tokenizer_and_fallback() -> None:
    routes = routes_from_flags(["chat=http://a:1", "big=http://b:2", "chat=http://c:3"],
                               aliases=["gpt-4o-mini=chat"], tokenizers=["chat=smollm2-135m-instruct"],
                               fallbacks=["big=chat"])
    assert routes == [
        ModelRoute("chat", "chat", ("http://a:1", "http://c:3"), aliases=("gpt-4o-mini",),
                   tokenizer="smollm2-135m-instruct"),
        ModelRoute("big", "big", ("http://b:2",), fallback="chat")]
    assert routes_from_flags(["http://a:1", "http://b:2"]) == []  # bare URLs: one fleet, as before


def test_a_model_name_becomes_a_fleet_name_fit_for_redis_keys() -> None:
    assert fleet_name_for("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB-SmolLM2-135M-Instruct"
    assert fleet_name_for("a{b}:c d") == "a-b-c-d"


@pytest.mark.parametrize(("engines", "extra", "says"), [
    (["a=http://x:1", "http://y:2"], {}, "name every --engine"),
    (["a=http://x:1"], {"aliases": ["b=nope"]}, "no --engine serves a model named 'nope'"),
    (["a=http://x:1", "b=http://y:2"], {"aliases": ["b=a"]}, "claimed by"),
    (["a=http://x:1"], {"fallbacks": ["a=a"]}, "its fallback must be another model"),
    (["a=http://x:1"], {"fallbacks": ["a=zz"]}, "its fallback must be another model"),
    (["a/b=http://x:1", "a-b=http://y:2"], {}, "would share the fleet name"),
    (["http://x:1"], {"aliases": ["b=a"]}, "--model-alias needs models named"),
    ([" =http://x:1"], {}, "a model name must be"),
])
def test_route_flags_that_cannot_work_are_refused_naming_the_flag(engines: list[str], extra: dict,
                                                                  says: str) -> None:
    with pytest.raises(ValueError, match=says):
        routes_from_flags(engines, **extra)


def test_the_table_resolves_names_and_aliases_and_answers_openai_errors_otherwise() -> None:
    from kvfleet.fleet.errors import APIError

    table = ModelTable([ModelRoute("a", "a", aliases=("alias",)), ModelRoute("b", "b")])
    assert table.resolve("alias") == "a" and table.resolve("b") == "b"
    for requested, status, code in (("gpt-5", 404, "model_not_found"), (None, 400, "model_required"),
                                    (7, 404, "model_not_found")):
        with pytest.raises(APIError) as refused:
            table.resolve(requested)
        assert (refused.value.status, refused.value.code, refused.value.param) == (status, code, "model")
        assert "`a`" in refused.value.message and "`b`" in refused.value.message  # says what to send instead
    assert ModelTable([ModelRoute("a", "a")]).resolve(None) == "a"  # one model: `model` may be left out


# ---- two models through one gateway, end to end ---------------------------------------------------------------

BIG, TINY, ALIAS = "smollm2", "tiny", "small"


@pytest.fixture(scope="module")
def engines(smollm2_dir, tiny_model_dir):
    (big_proc, big), = start_engine_servers(smollm2_dir, ("--served-model-name", BIG, "--kv-cache-memory", "32MiB"))
    (tiny_proc, tiny), = start_engine_servers(tiny_model_dir, ("--served-model-name", TINY, "--max-num-seqs", "1",
                                                               "--max-model-len", "1024", "--kv-cache-memory",
                                                               "32MiB"))
    yield {BIG: big, TINY: tiny}
    stop_process(big_proc)
    stop_process(tiny_proc)


@pytest.fixture(scope="module", params=["python", "envoy"])
def gateway(request, engines: dict[str, str], redis_server_module):
    proc, url = start_gateway("--engine", f"{BIG}={engines[BIG]}", "--engine", f"{TINY}={engines[TINY]}",
                              "--model-alias", f"{ALIAS}={TINY}", "--fallback", f"{TINY}={BIG}",
                              "--redis-url", redis_server_module.url, "--data-plane", request.param,
                              "--saturation-queue", "1", timeout=90.0)
    until(lambda: httpx.get(f"{url}/ready").json()["available"] >= 2, "the gateway never saw both engines")
    yield url
    stop_process(proc)


def metric(gateway: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (a label absent reads as "", as Prometheus
    has it)."""
    text = httpx.get(f"{gateway}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k, "") == v for k, v in labels.items()))


def test_each_model_is_answered_by_its_own_fleet_through_one_gateway(gateway: str, engines: dict[str, str],
                                                                      redis_server_module) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    listed = [m.id for m in client.models.list().data]
    assert sorted(listed) == sorted([BIG, TINY, ALIAS])
    answers = {}
    for model in (BIG, TINY, ALIAS):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0)
        answers[model] = raw.parse().choices[0].message.content
        served = TINY if model == ALIAS else model
        assert raw.parse().model == served
        assert raw.headers[ENGINE] == engines[served]
    assert answers[BIG] != answers[TINY]  # two different models, not one engine twice
    assert answers[ALIAS] == answers[TINY]  # greedy: the alias reached the same model
    for model in (BIG, TINY):  # every series of a model's fleet carries its name (Envoy's from its access log)
        until(lambda m=model: metric(gateway, "kvfleet_gateway_requests_total", model=m, code="200") >= 1,
              f"no answer counted for {model}", timeout=10)
    keys = redis.Redis.from_url(redis_server_module.url).keys("kvfleet:*")
    for model in (BIG, TINY):  # each fleet's Redis keys (its SLO counts, within a second of the answers)
        until(lambda m=model: any(k.decode().startswith(key_prefix(m)) for k in
                                  redis.Redis.from_url(redis_server_module.url).keys("kvfleet:*")),
              f"no Redis key of the {model} fleet among {keys}", timeout=5)


def test_an_unknown_or_missing_model_is_openais_error_naming_the_models_served(gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert unknown.value.body["code"] == "model_not_found" and f"`{BIG}`" in unknown.value.body["message"]
    missing = httpx.post(f"{gateway}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "model_required"
    hostile = httpx.post(f"{gateway}/v1/completions", headers={ALLOW_FALLBACK: "maybe"},
                         json={"model": TINY, "prompt": "hi", "max_tokens": 2})
    assert hostile.status_code == 400 and hostile.json()["error"]["param"] == ALLOW_FALLBACK
    # counted before any fleet was chosen: no model label (the picker counts once Envoy has the answer)
    until(lambda: metric(gateway, "kvfleet_gateway_requests_total", code="404", model="") >= 1,
          "the unknown model's 404 was not counted", timeout=10)


def complete(gateway: str, out: dict, name: str, **headers: str) -> None:
    out[name] = httpx.post(f"{gateway}/v1/completions", timeout=120, headers={PRIORITY: "standard", **headers},
                           json={"model": TINY, "prompt": "tell me more", "max_tokens": 4, "ignore_eos": True})


def test_a_saturated_model_falls_back_to_its_fallback_only_when_allowed_and_says_so(
        gateway: str, engines: dict[str, str]) -> None:
    fallback_count = {"model": BIG, "priority": "standard", "step": "fallback"}
    before, out = metric(gateway, "kvfleet_gateway_degraded_total", **fallback_count), {}
    with saturated(engines[TINY], TINY, (gateway,), served_as=TINY):
        complete(gateway, out, "allowed", **{ALLOW_FALLBACK: "true"})
        waiter = threading.Thread(target=complete, args=(gateway, out, "not allowed"))
        waiter.start()
        until(lambda: metric(gateway, "kvfleet_gateway_queue_depth", model=TINY, priority="standard") >= 1,
              "the request that may not fall back never waited in its model's queue")
    waiter.join()
    fell_back = out["allowed"]
    assert fell_back.status_code == 200, fell_back.text
    assert fell_back.json()["model"] == BIG and fell_back.headers[DEGRADED] == f"fallback={BIG}"
    assert fell_back.headers[ENGINE] == engines[BIG]
    until(lambda: metric(gateway, "kvfleet_gateway_degraded_total", **fallback_count) == before + 1,
          "the fallback was not counted", timeout=10)
    waited = out["not allowed"]  # served by its own model once the holders left
    assert waited.status_code == 200 and waited.json()["model"] == TINY and DEGRADED not in waited.headers
    with_room: list[httpx.Response] = []

    def served_by_its_own_model() -> bool:
        # room again: no fallback. A scrape that runs late on a busy machine reads as saturated for a moment (stale
        # metrics count as saturated) and the request rightly falls back; what must hold is that it comes back.
        out: dict = {}
        complete(gateway, out, "allowed", **{ALLOW_FALLBACK: "true"})
        with_room.append(out["allowed"])
        return out["allowed"].json()["model"] == TINY
    until(served_by_its_own_model, "requests never came back to their own model once it had room")
    assert all(r.status_code == 200 for r in with_room) and DEGRADED not in with_room[-1].headers


# ---- the models from Kubernetes: InferenceFleets by label selector ------------------------------------------------

def fleet(name: str, model: str, labels: dict | None = None, **gateway: object) -> dict:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": name, "namespace": "llm", "labels": labels or {}},
            "spec": {"model": model, **({"gateway": gateway} if gateway else {})}}


def test_inference_fleets_become_routes_and_what_cannot_be_served_is_said() -> None:
    from kvfleet.gateway.models.inference_fleets import routes_of_fleets

    routes, problems = routes_of_fleets([
        fleet("chat", "m-chat", modelAliases=["gpt-4o-mini", "m-code"], fallbackModel="m-small"),
        fleet("small", "m-small", fallbackModel="nobody", degradeMaxTokens={"standard": 64, "gold": 5, "sheddable": 0}),
        fleet("code", "m-code"),
        fleet("copy", "m-chat"),
        {"metadata": {"name": "broken"}, "spec": ["not", "an", "object"]},
    ])
    assert routes == [
        ModelRoute("m-chat", "chat", k8s_selector="kvfleet.io/fleet=chat", aliases=("gpt-4o-mini", "m-code"),
                   fallback="m-small"),
        ModelRoute("m-small", "small", k8s_selector="kvfleet.io/fleet=small",  # its fallback serves nothing
                   degrade_max_tokens={Priority.STANDARD: 64})]
    said = "\n".join(problems)
    assert "'broken' left out" in said and "'copy' left out: its model 'm-chat' is already served by fleet 'chat'" \
        in said
    assert "'code' left out: its model 'm-code' is already served by fleet 'chat'" in said  # chat's alias came first
    assert "fallbackModel 'nobody'" in said
    assert "degradeMaxTokens 'gold'" in said and "degradeMaxTokens 'sheddable': 0 left out" in said


def engine_pod(name: str, fleet_name: str, url: str) -> dict:
    port = int(url.rsplit(":", 1)[1])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "llm",
                                                            "labels": {"kvfleet.io/fleet": fleet_name}},
            "spec": {"containers": [{"name": "engine", "image": "kvfleet/engine:cpu",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_gateway_serves_every_selected_inference_fleet_and_drops_one_that_goes(engines: dict[str, str],
                                                                                tmp_path, monkeypatch) -> None:
    from kubernetes import client

    from kvfleet.local.kube_emulator import KubeEmulator

    emulator = KubeEmulator().start()
    try:
        api = emulator.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        selected = {"kvfleet.io/gateway": "main"}
        for name, model, labels in (("chat", BIG, selected), ("small", TINY, selected), ("other", "x", {})):
            custom.create_namespaced_custom_object("kvfleet.io", "v1alpha1", "llm", "inferencefleets",
                                                   fleet(name, model, labels, modelAliases=[ALIAS])
                                                   if name == "small" else fleet(name, model, labels))
        core.create_namespaced_pod("llm", engine_pod("chat-0", "chat", engines[BIG]))
        core.create_namespaced_pod("llm", engine_pod("small-0", "small", engines[TINY]))
        monkeypatch.setenv("KUBECONFIG", str(emulator.write_kubeconfig(tmp_path / "kubeconfig")))
        proc, url = start_gateway("--k8s-namespace", "llm", "--k8s-fleet-selector", "kvfleet.io/gateway=main",
                                  "--data-plane", "python")
        try:
            until(lambda: httpx.get(f"{url}/ready").json()["available"] >= 2, "the gateway never saw both fleets")
            assert sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]) == sorted([BIG, TINY, ALIAS])
            for model, served in ((BIG, BIG), (ALIAS, TINY)):
                answer = httpx.post(f"{url}/v1/completions", timeout=60,
                                    json={"model": model, "prompt": "hi", "max_tokens": 2})
                assert answer.status_code == 200 and answer.json()["model"] == served
                assert answer.headers[ENGINE] == engines[served]
            custom.delete_namespaced_custom_object("kvfleet.io", "v1alpha1", "llm", "inferencefleets", "small")
            until(lambda: httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": TINY, "prompt": "hi", "max_tokens": 2}).status_code == 404,
                "the deleted fleet's model was still served", timeout=20)
        finally:
            stop_process(proc)
    finally:
        emulator.stop()


def test_each_fleet_gets_its_route_settings_over_the_gateways() -> None:
    from kvfleet.gateway.config import GatewayConfig
    from kvfleet.gateway.models.front import ModelFront

    base = GatewayConfig(models=[ModelRoute("a", "a", ("http://x:1",))], fleet="ignored", k8s_namespace="llm",
                         degrade_max_tokens={Priority.STANDARD: 256})
    front = ModelFront(base, base.models)
    own = front._fleet(ModelRoute("b", "fleet-b", ("http://y:2",), degrade_max_tokens={Priority.SHEDDABLE: 8}))
    shared = front._fleet(ModelRoute("c", "fleet-c", k8s_selector="kvfleet.io/fleet=fleet-c"))
    assert (own.config.fleet, own.config.engines, own.config.degrade_max_tokens) == (
        "fleet-b", ["http://y:2"], {Priority.SHEDDABLE: 8})
    assert (shared.config.k8s_selector, shared.config.degrade_max_tokens) == (
        "kvfleet.io/fleet=fleet-c", {Priority.STANDARD: 256})
    assert base.degrade_max_tokens == {Priority.STANDARD: 256}  # the gateway's own settings untouched
