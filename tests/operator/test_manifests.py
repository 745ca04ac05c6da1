"""The InferenceFleet spec and the engine Deployment and Service built from it: pure functions.
Bad specs tried: no model, maxNumSeqs 0, a string maxModelLen, kvCacheMemory 'lots', extraArgs not strings,
minReplicas above maxReplicas, targetKVCacheUsage 0, replicas -1."""

from __future__ import annotations

import pytest

from kvfleet.operator.fleet_spec import InvalidSpec, parse_fleet
from kvfleet.operator.manifests import build_deployment, build_service, drifted, selector_labels

SPEC = {"model": "smollm2-135m-instruct", "image": "kvfleet/engine:cpu",
        "engine": {"maxModelLen": 2048, "maxNumSeqs": 64, "blockSize": 16, "kvCacheMemory": "1Gi",
                   "extraArgs": ["--seed", "3"]},
        "resources": {"limits": {"cpu": "2", "memory": "4Gi"}}, "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetKVCacheUsage": 0.6}}


def test_the_deployment_runs_the_engine_with_the_specs_settings() -> None:
    fleet = parse_fleet("chat", "llm", SPEC)
    dep = build_deployment(fleet, replicas=3)
    assert dep["metadata"] == {"name": "chat-engine", "namespace": "llm", "labels": dep["metadata"]["labels"]}
    assert dep["metadata"]["labels"]["kvfleet.io/fleet"] == "chat"
    assert dep["metadata"]["labels"]["app.kubernetes.io/name"] == "kvfleet-engine"
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]
    assert selector_labels("chat").items() <= pod["metadata"]["labels"].items()
    [c] = pod["spec"]["containers"]
    args = c["args"]
    assert args[:3] == ["engine", "--model", "smollm2-135m-instruct"]
    for flag, value in [("--max-model-len", "2048"), ("--max-num-seqs", "64"), ("--kv-cache-memory", "1Gi"),
                        ("--port", "8000"), ("--served-model-name", "smollm2-135m-instruct"), ("--seed", "3")]:
        assert args[args.index(flag) + 1] == value
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(args[args.index("--drain-timeout") + 1])
    assert c["resources"] == {"limits": {"cpu": "2", "memory": "4Gi"}}
    assert c["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]


def test_gpu_fleets_tolerate_gpu_nodes() -> None:
    spec = {**SPEC, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    pod = build_deployment(parse_fleet("g", "llm", spec), 1)["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "tolerations" not in build_deployment(parse_fleet("c", "llm", SPEC), 1)["spec"]["template"]["spec"]


def test_the_service_is_headless_on_the_http_port() -> None:
    svc = build_service(parse_fleet("chat", "llm", SPEC))
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == selector_labels("chat")
    assert svc["spec"]["ports"][0]["port"] == 8000


def test_autoscaling_settings_are_read() -> None:
    fleet = parse_fleet("chat", "llm", SPEC)
    assert fleet.autoscaling_enabled and fleet.autoscaling.max_replicas == 6
    assert fleet.autoscaling.target_kv_cache_usage == 0.6 and fleet.autoscaling.scale_down_stabilization_s == 300


@pytest.mark.parametrize("change,field", [
    ({"model": ""}, "spec.model"),
    ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    ({"engine": {"maxModelLen": "2048"}}, "spec.engine.maxModelLen"),
    ({"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
    ({"engine": {"extraArgs": [1]}}, "spec.engine.extraArgs"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
    ({"autoscaling": {"targetKVCacheUsage": 0}}, "targetKVCacheUsage"),
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": [1, 2]}, "spec.engine must be an object"),
    ({"autoscaling": "on"}, "spec.autoscaling must be an object"),
])
def test_invalid_specs_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        parse_fleet("chat", "llm", {**SPEC, **change})


def test_drift_is_what_differs_in_fields_we_set() -> None:
    desired = build_deployment(parse_fleet("chat", "llm", SPEC), 2)
    actual = {**desired, "status": {"replicas": 2}}
    actual["spec"] = {**desired["spec"], "revisionHistoryLimit": 10}  # API-server defaults are not drift
    assert drifted(desired, actual) == []
    edited = build_deployment(parse_fleet("chat", "llm", SPEC), 2)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    assert drifted(desired, edited) == ["spec.template.spec.containers[0].image"]


def token_ref(fleet_spec: dict, operator_default: str | None = None) -> dict | None:
    """The Secret reference the engine container gets KVFLEET_ENGINE_API_KEY from, or None."""
    [c] = build_deployment(parse_fleet("chat", "llm", fleet_spec, operator_default), 1)["spec"]["template"][
        "spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HOME"] == {"name": "HOME", "value": "/tmp"}
    token = env.get("KVFLEET_ENGINE_API_KEY")
    if token is None:
        return None
    assert set(token) == {"name", "valueFrom"}  # from the Secret, never written into the pod spec
    return token["valueFrom"]["secretKeyRef"]


def test_engine_pods_get_the_token_from_the_operators_secret_or_the_fleets_own() -> None:
    assert token_ref(SPEC) is None  # no Secret anywhere: engines run without a token, as before
    assert token_ref(SPEC, "kv-kvfleet-engine-auth") == {"name": "kv-kvfleet-engine-auth", "key": "api-key"}
    own = {**SPEC, "engineAuth": {"secretName": "chat-token", "secretKey": "token"}}
    assert token_ref(own, "kv-kvfleet-engine-auth") == {"name": "chat-token", "key": "token"}
    assert token_ref({**SPEC, "engineAuth": {"secretName": "chat-token"}}) == {"name": "chat-token", "key": "api-key"}
    assert token_ref({**SPEC, "engineAuth": {"secretName": ""}}, "kv-kvfleet-engine-auth") is None  # turned off


@pytest.mark.parametrize(("auth", "message"), [
    ("chat-token", "spec.engineAuth must be an object"),
    ({"secretName": 7}, "spec.engineAuth.secretName must be a Secret name"),
    ({"secretName": "t", "secretKey": ""}, "spec.engineAuth.secretKey must be a key"),
])
def test_a_bad_engine_auth_names_the_field(auth: object, message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        parse_fleet("chat", "llm", {**SPEC, "engineAuth": auth})
