"""spec.autoscaling.warmPool: read and checked (CRD schema and parser, hostile values refused naming the field), the
Deployment it makes (the pool's pods on top of spec.replicas, engines in sleep mode), the pure plan, and the sync
against real engine processes: idle pods beyond spec.replicas go to sleep, and wake when the autoscaler wants more."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import jsonschema
import pytest

from kvfleet.operator.crd import build_crd
from kvfleet.operator.fleet_spec import InvalidSpec, parse_fleet
from kvfleet.operator.manifests import build_deployment
from kvfleet.operator.warm_pool import PodState, plan_warm_pool, pool_states, settle_warm_pool
from kvfleet.operator.warm_pool_spec import WarmPool
from tests.conftest import start_engine_servers, stop_process

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def spec(warm: object, runtime: str = "kvfleet") -> dict:
    return {"model": "smollm2-135m-instruct", "runtime": runtime, "replicas": 2,
            "autoscaling": {"enabled": True, "warmPool": warm}}


def test_a_warm_pool_adds_its_pods_to_the_deployment_and_puts_the_engines_in_sleep_mode() -> None:
    given = spec({"replicas": 3, "wakeSeconds": 2})
    jsonschema.validate({"spec": given}, SCHEMA)
    fleet = parse_fleet("chat", "ns", given)
    assert fleet.warm_pool == WarmPool(3, 2.0) and fleet.pods == 5
    deployment = build_deployment(fleet, fleet.pods)
    assert deployment["spec"]["replicas"] == 5
    assert "--enable-sleep-mode" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    # asleep pods are not Ready: a rollout may count them unavailable, or it would never finish
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 3, "maxSurge": 1}
    without = parse_fleet("chat", "ns", spec({"replicas": 0}))
    assert without.warm_pool is None and without.pods == 2
    template = build_deployment(without, 2)["spec"]["template"]
    assert "--enable-sleep-mode" not in template["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("warm", "runtime", "says"), [
    ({"replicas": -1}, "kvfleet", "warmPool.replicas must be an integer from 0 to 100"),
    ({"replicas": 101}, "kvfleet", "warmPool.replicas must be an integer from 0 to 100"),
    ({"replicas": True}, "kvfleet", "warmPool.replicas must be an integer"),
    ({"replicas": 1, "wakeSeconds": "5"}, "kvfleet", "warmPool.wakeSeconds must be a number from 0 to 600"),
    ({"replicas": 1, "wakeSeconds": 1e9}, "kvfleet", "warmPool.wakeSeconds must be a number from 0 to 600"),
    ({"replicas": 1, "size": 2}, "kvfleet", "warmPool.size is not a field"),
    ("2", "kvfleet", "warmPool must be an object"),
    ({"replicas": 1}, "vllm", "warmPool needs runtime kvfleet"),
])
def test_a_hostile_warm_pool_is_refused_naming_the_field(warm: object, runtime: str, says: str) -> None:
    with pytest.raises(InvalidSpec, match=says):
        parse_fleet("chat", "ns", spec(warm, runtime))
    # the CRD's schema refuses the same before the operator sees it (an unknown field: the API server refuses it under
    # strict field validation, kubectl's default, and prunes it otherwise)
    if runtime == "kvfleet" and "size" not in warm:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"spec": spec(warm)}, SCHEMA)


def test_the_plan_wakes_asleep_pods_for_more_replicas_and_puts_the_least_loaded_spare_ones_to_sleep() -> None:
    pods = [PodState("a", False, load=7), PodState("b", False, load=2), PodState("c", False, load=None),
            PodState("z", True)]
    assert plan_warm_pool(pods, active=1, pool=2) == ([], ["b"])  # one slot left in the pool: the least loaded
    assert plan_warm_pool(pods, active=1, pool=3) == ([], ["b", "a"])  # unscraped pods last
    assert plan_warm_pool(pods, active=3, pool=2) == ([], [])  # all three serve; the pool waits for new pods
    assert plan_warm_pool(pods, active=4, pool=2) == (["z"], [])
    assert plan_warm_pool(pods, active=1, pool=1) == ([], [])  # the pool is full
    assert plan_warm_pool(pods, active=1, pool=2, may_sleep=False) == ([], [])  # a rollout in progress
    assert plan_warm_pool(pods, active=4, pool=2, may_sleep=False) == (["z"], [])  # waking never waits
    assert plan_warm_pool([PodState("z", True), PodState("y", True)], active=0, pool=2) == ([], [])


def pod(url: str, ready: bool) -> dict:
    port = int(url.rsplit(":", 1)[1])
    return {"metadata": {"name": f"engine-{port}"},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": str(ready)}]},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]}}


@pytest.fixture(scope="module")
def sleepy_engines(tiny_model_dir: Path):
    started = start_engine_servers(tiny_model_dir, ("--enable-sleep-mode",), ("--enable-sleep-mode",))
    yield [url for _, url in started]
    for proc, _ in started:
        stop_process(proc)


def test_the_operator_sleeps_a_spare_idle_engine_and_wakes_it_for_a_scale_up(sleepy_engines: list[str]) -> None:
    fleet = parse_fleet("chat", "ns", spec({"replicas": 1, "wakeSeconds": 2}))

    def period(active: int) -> dict:
        objects = [pod(u, httpx.get(f"{u}/ready").status_code == 200) for u in sleepy_engines]  # as kubelet probes
        states = asyncio.run(pool_states(objects, dict.fromkeys(sleepy_engines, 0), 5.0))
        return asyncio.run(settle_warm_pool(fleet, fleet.warm_pool, states, active))

    assert period(active=1) == {"warmPool": {"replicas": 1, "asleep": 1, "woken": 0, "slept": 1}}
    asleep = [u for u in sleepy_engines if httpx.get(f"{u}/is_sleeping").json()["is_sleeping"]]
    assert len(asleep) == 1 and httpx.get(f"{asleep[0]}/ready").status_code == 503
    assert period(active=1) == {"warmPool": {"replicas": 1, "asleep": 1, "woken": 0, "slept": 0}}  # settled
    assert period(active=2) == {"warmPool": {"replicas": 1, "asleep": 0, "woken": 1, "slept": 0}}
    for url in sleepy_engines:
        assert httpx.get(f"{url}/ready").status_code == 200
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert answer.status_code == 200


def test_a_pod_once_asleep_is_never_sampled_as_a_cold_start() -> None:
    """Its Ready time is its latest wake's: creation to then is no cold start (it would stretch the planner's
    horizon). The memory keeps only pods that still exist."""
    from kvfleet.operator.handlers import FleetHandlers
    from kvfleet.operator.settings import OperatorConfig

    handlers = FleetHandlers(OperatorConfig())
    a, b = pod("http://127.0.0.1:9001", ready=False), pod("http://127.0.0.1:9002", ready=True)
    a["metadata"]["uid"], b["metadata"]["uid"] = "uid-a", "uid-b"
    asleep = [PodState("http://127.0.0.1:9001", True), PodState("http://127.0.0.1:9002", False, load=0)]
    assert handlers.slept_pods("ns/chat", [a, b], asleep) == {"uid-a"}
    awake_again = [PodState("http://127.0.0.1:9001", False, load=0), PodState("http://127.0.0.1:9002", False)]
    assert handlers.slept_pods("ns/chat", [a, b], awake_again) == {"uid-a"}  # woken: still not a cold start
    assert handlers.slept_pods("ns/chat", [b], awake_again) == set()  # gone: forgotten
