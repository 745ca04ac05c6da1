"""An InferenceFleet's LoRA adapters as fleet resources: spec.lora and spec.loraAdapters read and checked (by the
CRD's schema and the operator's parser, each hostile value refused naming the field), the engine pods they make
(LoRA flags, the store mounted read-only, vLLM's runtime-loading switch), the per-pod plan of loads and unloads,
and the status. tests/kvfleet/local/test_cluster.py runs the whole path against a live engine pod."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvfleet.operator.crd import build_crd
from kvfleet.operator.fleet_spec import InvalidSpec, parse_fleet
from kvfleet.operator.lora_spec import STORE_MOUNT, FleetAdapter, FleetLora
from kvfleet.operator.lora_sync import PodAdapters, Served, lora_status, plan_pod, served_adapters
from kvfleet.operator.manifests import build_deployment

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
STORE = {"persistentVolumeClaim": {"claimName": "lora-adapters"}}


def spec(lora: object = None, adapters: object = None, runtime: str = "kvfleet") -> dict:
    out: dict = {"model": "smollm2-135m-instruct", "runtime": runtime}
    if lora is not None:
        out["lora"] = lora
    if adapters is not None:
        out["loraAdapters"] = adapters
    return out


def container(fleet_spec: dict) -> tuple[dict, dict]:
    pod = build_deployment(parse_fleet("chat", "ns", fleet_spec), 1)["spec"]["template"]["spec"]
    return pod["containers"][0], pod


def test_a_fleet_with_adapters_starts_engines_with_lora_on_and_the_store_mounted() -> None:
    given = spec({"store": STORE, "maxLoras": 4, "maxCpuLoras": 8},
                 [{"name": "sql", "rank": 32, "pinned": True}, {"name": "poet", "path": "team/poet"}])
    jsonschema.validate({"spec": given}, SCHEMA)
    fleet = parse_fleet("chat", "ns", given)
    assert fleet.lora == FleetLora(STORE, STORE_MOUNT, (FleetAdapter("sql", "sql", 32, True),
                                                        FleetAdapter("poet", "team/poet")), 4, 32, 8)
    engine, pod = container(given)
    args = engine["args"]
    assert args[args.index("--max-loras") + 1] == "4" and args[args.index("--max-lora-rank") + 1] == "32"
    assert "--enable-lora" in args and args[args.index("--lora-allowed-dirs") + 1] == STORE_MOUNT
    assert {"name": "lora-store", "mountPath": STORE_MOUNT, "readOnly": True} in engine["volumeMounts"]
    assert {"name": "lora-store", **STORE} in pod["volumes"]
    # The adapters themselves are not in the pod template: editing the list rolls no pod.
    assert "sql" not in json.dumps(engine) and "team/poet" not in json.dumps(engine)
    assert fleet.lora.path_of(fleet.lora.adapters[1]) == f"{STORE_MOUNT}/team/poet"


def test_the_pod_template_does_not_change_when_adapters_do() -> None:
    one = build_deployment(parse_fleet("chat", "ns", spec({"store": STORE}, [{"name": "sql"}])), 1)
    two = build_deployment(parse_fleet("chat", "ns", spec({"store": STORE}, [{"name": "poet"}, {"name": "x"}])), 1)
    assert one == two


def test_a_vllm_fleet_gets_vllms_flags_and_runtime_loading() -> None:
    engine, _ = container(spec({"store": STORE}, [{"name": "sql", "rank": 8}], runtime="vllm"))
    assert engine["command"] == ["vllm", "serve"]
    args = engine["args"]
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "16"
    assert "--lora-allowed-dirs" not in args  # not a vLLM flag
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in engine["env"]


def test_adapters_in_the_image_need_no_volume() -> None:
    engine, pod = container(spec({"path": "/opt/adapters"}, [{"name": "sql"}]))
    assert engine["args"][engine["args"].index("--lora-allowed-dirs") + 1] == "/opt/adapters"
    assert not [v for v in pod["volumes"] if v["name"] == "lora-store"]


def test_a_fleet_without_adapters_has_no_lora() -> None:
    engine, _ = container(spec())
    assert "--enable-lora" not in engine["args"] and parse_fleet("c", "n", spec()).lora is None


HOSTILE = [  # (spec.lora, spec.loraAdapters, runtime, the parser's message, whether the CRD schema refuses it too)
    (None, [{"name": "sql"}], "kvfleet", "needs spec.lora", False),  # a CEL rule: the API server refuses it
    ({}, [{"name": "sql"}], "kvfleet", "needs a store", False),
    ({"store": {"emptyDir": {}}}, [], "kvfleet", "spec.lora.store must be one volume source", False),
    ({"store": {**STORE, "hostPath": {"path": "/x"}}}, [], "kvfleet", "spec.lora.store", True),
    ({"store": STORE, "path": "/a/../etc"}, [], "kvfleet", "spec.lora.path", True),
    ({"store": STORE, "path": "relative"}, [], "kvfleet", "spec.lora.path", True),
    ({"store": STORE}, [{"name": "x", "path": "../../etc"}], "kvfleet", "spec.loraAdapters[0].path", True),
    ({"store": STORE}, [{"name": "x", "path": "/etc"}], "kvfleet", "spec.loraAdapters[0].path", True),
    ({"store": STORE}, [{"name": "x", "path": "a/.hidden"}], "kvfleet", "spec.loraAdapters[0].path", True),
    ({"store": STORE}, [{"name": "../x"}], "kvfleet", "spec.loraAdapters[0].name", True),
    ({"store": STORE}, [{"name": "x" * 200}], "kvfleet", "spec.loraAdapters[0].name", True),
    ({"store": STORE}, [{"name": "sql"}, {"name": "sql"}], "kvfleet", "twice", False),  # a list-map key: the API
    ({"store": STORE}, [{"name": "smollm2-135m-instruct"}], "kvfleet", "base model's name", False),
    ({"store": STORE, "maxLoraRank": 8}, [{"name": "x", "rank": 16}], "kvfleet", "rank", False),
    ({"store": STORE}, [{"name": "x", "rank": 0}], "kvfleet", "rank", True),
    ({"store": STORE}, [{"name": "x", "rank": True}], "kvfleet", "rank", True),
    ({"store": STORE}, [{"name": "x", "pinned": "yes"}], "kvfleet", "pinned", True),
    ({"store": STORE}, [{"name": "x", "extra": 1}], "kvfleet", "not a field", False),  # pruned by the API server
    ({"store": STORE, "maxLoras": 0}, [], "kvfleet", "spec.lora.maxLoras", True),
    ({"store": STORE, "maxLoras": 2, "maxCpuLoras": 1}, [], "kvfleet", "spec.lora.maxCpuLoras", False),
    ({"store": STORE, "maxLoras": 1}, [{"name": "a", "pinned": True}, {"name": "b", "pinned": True}], "kvfleet",
     "pins 2 adapters", False),
    ({"store": STORE, "maxLoraRank": 20}, [], "vllm", "vLLM takes one of", False),
    ([STORE], [], "kvfleet", "spec.lora must be an object", True),
    ({"store": STORE}, {"name": "sql"}, "kvfleet", "spec.loraAdapters must be a list", True),
]


@pytest.mark.parametrize(("lora", "adapters", "runtime", "says", "schema_refuses"), HOSTILE,
                         ids=[f"{k}-{h[3]}" for k, h in enumerate(HOSTILE)])
def test_a_hostile_lora_spec_is_refused_naming_the_field(lora: object, adapters: object, runtime: str, says: str,
                                                         schema_refuses: bool) -> None:
    given = spec(lora, adapters, runtime)
    with pytest.raises(InvalidSpec, match=says.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        parse_fleet("chat", "ns", given)
    if schema_refuses:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"spec": given}, SCHEMA)


def test_the_crd_carries_the_cross_field_rules_and_the_printer_column() -> None:
    crd = build_crd()["spec"]["versions"][0]
    rules = [r["rule"] for r in SCHEMA["properties"]["spec"]["x-kubernetes-validations"]]
    assert any("a.rank <= self.lora.maxLoraRank" in r for r in rules) and any("has(self.lora)" in r for r in rules)
    column = next(c for c in crd["additionalPrinterColumns"] if c["name"] == "Adapters")
    assert column["jsonPath"] == ".status.loraAdaptersReady"


LORA = FleetLora(STORE, STORE_MOUNT, (FleetAdapter("sql", "sql"), FleetAdapter("poet", "team/poet", pinned=True)))


def test_a_new_pod_gets_every_adapter() -> None:
    load, unload = plan_pod(LORA, {}, "kvfleet")
    assert [a.name for a in load] == ["sql", "poet"] and unload == []


def test_an_adapter_taken_out_of_the_spec_is_unloaded_but_the_engines_own_stay() -> None:
    served = {"sql": Served(f"{STORE_MOUNT}/sql"), "poet": Served(f"{STORE_MOUNT}/team/poet", pinned=True),
              "gone": Served(f"{STORE_MOUNT}/gone"), "own": Served("/models/own")}  # --lora-modules at start
    assert plan_pod(LORA, served, "kvfleet") == ([], ["gone"])


def test_an_adapter_moved_or_pinned_otherwise_is_loaded_again() -> None:
    served = {"sql": Served(f"{STORE_MOUNT}/old-sql"), "poet": Served(f"{STORE_MOUNT}/team/poet", pinned=False)}
    load, unload = plan_pod(LORA, served, "kvfleet")
    assert sorted(unload) == ["poet", "sql"] and sorted(a.name for a in load) == ["poet", "sql"]
    # vLLM does not pin: its pods are not reloaded for it
    assert plan_pod(LORA, {**served, "sql": Served(f"{STORE_MOUNT}/sql")}, "vllm") == ([], [])


def test_served_adapters_reads_vllm_and_kvfleet_model_lists() -> None:
    body = {"data": [{"id": "base", "parent": None, "root": "/m"},
                     {"id": "sql", "parent": "base", "root": "/lora/sql", "pinned": True},
                     {"id": "poet", "parent": "base", "root": "/lora/poet"}, "junk", {"parent": "base"}]}
    assert served_adapters(body) == {"sql": Served("/lora/sql", True), "poet": Served("/lora/poet")}
    with pytest.raises(ValueError):
        served_adapters({"data": "nope"})


def test_the_status_names_each_adapters_pods_and_a_failed_loads_answer() -> None:
    pods = [PodAdapters("a", {"sql", "poet"}), PodAdapters("b", {"poet"}, {"sql": "400: rank 32 is over 16"}),
            PodAdapters("c", reachable=False)]
    assert lora_status(LORA, pods) == {
        "loraAdapters": [{"name": "sql", "pods": ["a"], "error": "b: 400: rank 32 is over 16"},
                         {"name": "poet", "pods": ["a", "b"]}],
        "loraAdaptersReady": "1/2"}
    assert lora_status(LORA, [])["loraAdaptersReady"] == "0/2"
