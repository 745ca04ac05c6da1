"""spec.autoscaling.sloClasses: the CRD's schema and the operator's parser take each class's objective, default
what is left out from kvfleet/fleet/slo.py, refuse hostile values and unknown classes with a message naming the
field; the real operator (against KMock's emulator, as tests/operator/test_kmock.py) reports status.sloAttainment
from the gateways' per-class counts in Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jsonschema
import pytest
import redis
from kubernetes import client

from kvfleet.fleet import redis_keys
from kvfleet.fleet.priority import Priority
from kvfleet.fleet.slo import DEFAULT_SLO_CLASSES, SloClass
from kvfleet.fleet.slo_stats import (
    ARRIVALS,
    COMPLETED,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    SHED,
    field,
    slot_start,
    ttft_bucket,
)
from kvfleet.local.kube_emulator import KubeEmulator
from kvfleet.local.redis_server import RedisServer
from kvfleet.operator.crd import build_crd
from kvfleet.operator.fleet_spec import InvalidSpec, parse_fleet
from kvfleet.operator.planner import Capacity
from tests.support.kmock import FLEETS, create_fleet, eventually

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SLO_SCHEMA = SCHEMA["properties"]["spec"]["properties"]["autoscaling"]["properties"]["sloClasses"]


def fleet_doc(slo_classes: object) -> dict:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": "f"},
            "spec": {"model": "m", "autoscaling": {"enabled": True, "sloClasses": slo_classes}}}


def test_a_class_or_field_left_out_keeps_the_documented_default() -> None:
    given = {"critical": {"ttftSeconds": 0.5}, "standard": {"attainment": 0.95, "tpotSeconds": 0.1}}
    jsonschema.validate(fleet_doc(given), SCHEMA)
    slo = parse_fleet("f", "ns", fleet_doc(given)["spec"]).autoscaling.slo
    assert slo[Priority.CRITICAL] == SloClass(0.5, DEFAULT_SLO_CLASSES[Priority.CRITICAL].attainment)
    assert slo[Priority.STANDARD] == SloClass(DEFAULT_SLO_CLASSES[Priority.STANDARD].ttft_s, 0.95, 0.1)
    assert slo[Priority.SHEDDABLE] == DEFAULT_SLO_CLASSES[Priority.SHEDDABLE]
    assert parse_fleet("f", "ns", {"model": "m"}).autoscaling.slo == DEFAULT_SLO_CLASSES


def test_the_schemas_defaults_are_the_contracts() -> None:
    for priority, objective in DEFAULT_SLO_CLASSES.items():
        fields = SLO_SCHEMA["properties"][priority.value]["properties"]
        assert fields["ttftSeconds"]["default"] == objective.ttft_s
        assert fields["attainment"]["default"] == objective.attainment
    assert set(SLO_SCHEMA["properties"]) == {p.value for p in Priority}
    # No class outside the declared ones survives the API server (pruned, or refused by kubectl's strict check).
    assert "additionalProperties" not in SLO_SCHEMA and "x-kubernetes-preserve-unknown-fields" not in SLO_SCHEMA


HOSTILE = [
    ({"critical": {"ttftSeconds": -1}}, "spec.autoscaling.sloClasses.critical.ttftSeconds", True),
    ({"critical": {"ttftSeconds": 0}}, "spec.autoscaling.sloClasses.critical.ttftSeconds", False),  # CEL: > 0
    ({"standard": {"attainment": 1.5}}, "spec.autoscaling.sloClasses.standard.attainment", True),
    ({"standard": {"attainment": 1}}, "spec.autoscaling.sloClasses.standard.attainment", False),  # CEL: < 1
    ({"standard": {"attainment": -0.1}}, "spec.autoscaling.sloClasses.standard.attainment", True),
    ({"critical": {"ttftSeconds": "1s"}}, "spec.autoscaling.sloClasses.critical.ttftSeconds", True),
    ({"critical": {"attainment": True}}, "spec.autoscaling.sloClasses.critical.attainment", True),
    ({"sheddable": {"tpotSeconds": 61}}, "spec.autoscaling.sloClasses.sheddable.tpotSeconds", True),
    ({"critical": {"ttftSeconds": 1e9}}, "spec.autoscaling.sloClasses.critical.ttftSeconds", True),
    ({"critical": "fast"}, "spec.autoscaling.sloClasses.critical", True),
    ({"critical": {"ttft": 1}}, "spec.autoscaling.sloClasses.critical.ttft", False),  # pruned by the API server
    ({"vip": {"ttftSeconds": 1}}, "spec.autoscaling.sloClasses.vip", False),  # pruned by the API server
    (["critical"], "spec.autoscaling.sloClasses", True),
]


@pytest.mark.parametrize(("given", "field_name", "schema_refuses"), HOSTILE, ids=[json.dumps(h[0]) for h in HOSTILE])
def test_hostile_values_are_refused_naming_the_field(given: object, field_name: str, schema_refuses: bool) -> None:
    with pytest.raises(InvalidSpec) as refused:
        parse_fleet("f", "ns", fleet_doc(given)["spec"])
    assert str(refused.value).startswith(field_name + " ") or str(refused.value).startswith(field_name + ".")
    if schema_refuses:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(fleet_doc(given), SCHEMA)


def test_an_unknown_class_is_refused_with_the_classes_to_write() -> None:
    with pytest.raises(InvalidSpec, match="vip is not a priority class; write critical, standard, sheddable"):
        parse_fleet("f", "ns", fleet_doc({"vip": {"ttftSeconds": 1}})["spec"])


def capacity_doc(capacity: object) -> dict:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": "f"},
            "spec": {"model": "m", "runtime": "vllm", "autoscaling": {"enabled": True, "capacity": capacity}}}


def test_a_profiled_capacity_is_taken_and_left_out_means_the_pods_measure_it() -> None:
    given = {"prefillTokensPerSecond": 480, "decodeTokensPerSecond": 116.5}
    jsonschema.validate(capacity_doc(given), SCHEMA)
    assert parse_fleet("f", "ns", capacity_doc(given)["spec"]).autoscaling.capacity == Capacity(480.0, 116.5)
    assert parse_fleet("f", "ns", {"model": "m"}).autoscaling.capacity is None


HOSTILE_CAPACITY = [
    ({"prefillTokensPerSecond": 480}, "decodeTokensPerSecond", True),  # both or neither
    ({"prefillTokensPerSecond": 0, "decodeTokensPerSecond": 10}, "prefillTokensPerSecond", False),  # CEL: > 0
    ({"prefillTokensPerSecond": -5, "decodeTokensPerSecond": 10}, "prefillTokensPerSecond", True),
    ({"prefillTokensPerSecond": "fast", "decodeTokensPerSecond": 10}, "prefillTokensPerSecond", True),
    ({"prefillTokensPerSecond": True, "decodeTokensPerSecond": 10}, "prefillTokensPerSecond", True),
    ({"prefillTokensPerSecond": 480, "decodeTokensPerSecond": 1e12}, "decodeTokensPerSecond", True),
    ({"prefillTokensPerSecond": 480, "decodeTokensPerSecond": 10, "batch": 4}, "batch", False),  # pruned
    ([480, 10], "", True),
]


@pytest.mark.parametrize(("given", "field_name", "schema_refuses"), HOSTILE_CAPACITY,
                         ids=[json.dumps(h[0]) for h in HOSTILE_CAPACITY])
def test_a_hostile_capacity_is_refused_naming_the_field(given: object, field_name: str, schema_refuses: bool) -> None:
    with pytest.raises(InvalidSpec) as refused:
        parse_fleet("f", "ns", capacity_doc(given)["spec"])
    where = "spec.autoscaling.capacity" + (f".{field_name}" if field_name else "")
    assert str(refused.value).startswith(where + " ")
    if schema_refuses:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(capacity_doc(given), SCHEMA)


@pytest.fixture(scope="module")
def operator(tmp_path_factory):
    emulator = KubeEmulator().start()
    kubeconfig = emulator.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config.json")
    redis_server = RedisServer().start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "operator", "--metrics-port", "0", "--liveness", "",
         "--redis-url", redis_server.url, "--autoscale-interval", "1"],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=open(tmp_path_factory.mktemp("op") / "log", "w"),
        stderr=subprocess.STDOUT)
    yield emulator.api_client(), redis_server
    proc.terminate()
    proc.wait(timeout=30)
    redis_server.stop()
    emulator.stop()


def status(api_client, name: str) -> dict:
    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(*FLEETS, name).get("status") or {}


def test_status_reports_each_classes_attainment_from_the_gateways_counts(operator) -> None:
    api_client, redis_server = operator
    # What the gateways counted of the critical class in the current slot: 9 answered (6 within 0.4 s, 3 within
    # 0.9 s) and 1 shed, against an objective of 0.5 s.
    counts = {field(Priority.CRITICAL, ARRIVALS): 10, field(Priority.CRITICAL, COMPLETED): 9,
              field(Priority.CRITICAL, SHED): 1, field(Priority.CRITICAL, ttft_bucket(0.4)): 6,
              field(Priority.CRITICAL, ttft_bucket(0.9)): 3}
    redis.Redis.from_url(redis_server.url).hset(redis_keys.slo_slot_key("slo", slot_start(time.time())),
                                                mapping=counts)
    create_fleet(api_client, "slo", {"model": "smollm2-135m-instruct", "replicas": 0,
                                     "autoscaling": {"sloClasses": {"critical": {"ttftSeconds": 0.5}}}})
    report = eventually(lambda: status(api_client, "slo").get("sloAttainment"), timeout=20)
    critical, standard = report["critical"], report["standard"]
    assert (critical["ttftSeconds"], critical["target"], critical["requests"], critical["shed"]) == (0.5, 0.999, 10, 1)
    assert critical["attained"] == pytest.approx(6 / 10, abs=0.01)  # a shed request is a miss
    assert 600 <= critical["windowSeconds"] <= 605
    # The defaults; nothing counted: no attainment to claim (null, which a merge patch writes as an absent field).
    assert (standard["ttftSeconds"], standard["target"], standard.get("attained"), standard["requests"]) == (
        2.0, 0.99, None, 0)
    assert report["sheddable"]["target"] == 0.0


def test_an_unknown_class_in_a_fleet_gets_a_condition_naming_it(operator) -> None:
    api_client, _ = operator
    create_fleet(api_client, "typo", {"model": "smollm2-135m-instruct",
                                      "autoscaling": {"sloClasses": {"premium": {"ttftSeconds": 1}}}})

    def degraded():
        conditions = {c["type"]: c for c in status(api_client, "typo").get("conditions") or []}
        return conditions["Degraded"]["reason"] == "InvalidSpec" and conditions["Degraded"]["message"]
    message = eventually(degraded)
    assert "spec.autoscaling.sloClasses.premium" in message and "critical, standard, sheddable" in message


def test_the_planner_reads_each_classes_demand_over_the_fleets_stable_window(operator) -> None:
    """A burst the gateways counted 40 s ago is demand for a fleet that averages over the default minute and is over
    for one whose stableWindowSeconds is 10, as Knative's stable window (the planner's demand: status.autoscaler)."""
    api_client, redis_server = operator
    counts = {field(Priority.STANDARD, ARRIVALS): 600, field(Priority.STANDARD, COMPLETED): 600,
              field(Priority.STANDARD, PROMPT_TOKENS): 600 * 200, field(Priority.STANDARD, OUTPUT_TOKENS): 600 * 50}
    for name, stable_s in (("minute", 60), ("short", 10)):
        redis.Redis.from_url(redis_server.url).hset(
            redis_keys.slo_slot_key(name, slot_start(time.time() - 40)), mapping=counts)
        create_fleet(api_client, name, {"model": "smollm2-135m-instruct", "replicas": 1, "autoscaling": {
            "enabled": True, "maxReplicas": 8, "stableWindowSeconds": stable_s,
            "capacity": {"prefillTokensPerSecond": 480, "decodeTokensPerSecond": 116.5}}})

    def work(name: str) -> float | None:
        plan = ((status(api_client, name).get("autoscaler") or {}).get("lastDecision") or {}).get("inputs", {}).get(
            "plan")
        return None if plan is None else plan["workPods"]["standard"]
    assert eventually(lambda: work("minute"), timeout=20) > 1  # 10 requests/s of 200 + 50 tokens: pods of work
    assert eventually(lambda: work("short") is not None, timeout=20) and work("short") == 0
