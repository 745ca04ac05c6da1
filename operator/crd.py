"""The InferenceFleet CustomResourceDefinition, built in one place (the chart's crds/ file is generated from it:
`python -m kvfleet.operator.crd > charts/kvfleet/crds/inferencefleets.kvfleet.io.yaml`, and a test checks it)."""

from __future__ import annotations

import sys

from kvfleet.fleet.engine_settings import crd_engine_properties
from kvfleet.fleet.priority import PRIORITY_NAMES, Priority
from kvfleet.fleet.slo import DEFAULT_SLO_CLASSES, SloClass
from kvfleet.operator.cold_start import KEEP, PERCENTILE
from kvfleet.operator.fleet_fields import (
    AUTOSCALING_ENABLED,
    AUTOSCALING_FIELDS,
    DEFAULT_RUNTIME,
    RUNTIMES,
    SPEC_FIELDS,
)
from kvfleet.operator.fleet_spec import (
    CAPACITY_FIELDS,
    ENGINE_API_KEY_ENV,
    ENGINE_API_KEY_SECRET_KEY,
    GROUP,
    KIND,
    MAX_TOKENS_PER_S,
    PLURAL,
    VERSION,
)
from kvfleet.operator.forecast import STATUS_SCHEMA as FORECAST_SCHEMA
from kvfleet.operator.lora_spec import RANK_RULE, STORE_RULE, lora_schemas
from kvfleet.operator.warm_pool_spec import schema as warm_pool_schema


def _open_bound(rule: str, message: str) -> dict:
    """An exclusive bound as a CEL rule: Kubernetes' boolean exclusiveMinimum is not JSON Schema's (a number), and
    the chart's checks validate with the latter."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


# SloClass.__post_init__'s bounds in schema form (tests/operator/test_slo_classes.py probes both at the edges).
SLO_FIELD_BOUNDS = {
    "ttftSeconds": {"minimum": 0, "maximum": 3600, **_open_bound("self > 0.0", "ttftSeconds must be above 0")},
    "attainment": {"minimum": 0, "maximum": 1,
                   **_open_bound("self < 1.0", "attainment must be below 1 (0.999 is 99.9 %)")},
    "tpotSeconds": {"minimum": 0, "maximum": 60, **_open_bound("self > 0.0", "tpotSeconds must be above 0")},
}


def slo_class_schema(default: SloClass) -> dict:
    """One class's objective; each field defaults to kvfleet/fleet/slo.py's DEFAULT_SLO_CLASSES."""
    fields = {
        "ttftSeconds": ("time to first token, seconds from the request reaching the gateway", default.ttft_s),
        "attainment": ("the share of the class's requests that must meet it (0.999 is 99.9 %); 0: best effort",
                       default.attainment),
        "tpotSeconds": ("time per output token, seconds; absent: no objective", default.tpot_s),
    }
    properties = {}
    for name, (text, value) in fields.items():
        properties[name] = {"type": "number", **SLO_FIELD_BOUNDS[name], "description": text}
        if value is not None:
            properties[name]["default"] = value
    share = "best effort" if default.best_effort else f"for {default.attainment:.1%} of requests"
    return {"type": "object", "properties": properties,
            "description": f"default: TTFT <= {default.ttft_s:g} s, {share}"}


def capacity_schema() -> dict:
    """spec.autoscaling.capacity: both rates or neither (operator/fleet_spec.py's _capacity reads it)."""
    rate = {"type": "number", "minimum": 0, "maximum": MAX_TOKENS_PER_S,
            **_open_bound("self > 0.0", "a rate must be above 0")}
    return {"type": "object", "required": list(CAPACITY_FIELDS),
            "description": "one engine pod's capacity, as profiled (`kvfleet bench capacity`), for the SLO planner: "
                           "kvfleet engines measure their own and it wins; vLLM pods do not, and without this their "
                           "fleet scales on KV usage and queue length",
            "properties": {key: rate | {"description": text} for key, (_, text) in CAPACITY_FIELDS.items()}}


def slo_classes_schema() -> dict:
    """spec.autoscaling.sloClasses: a class absent keeps its defaults; unknown class names are refused."""
    # An unknown class is an unknown field: the API server refuses it under strict field validation (kubectl's
    # default) and prunes it otherwise; the operator's parser refuses it too (CEL cannot see undeclared fields).
    return {"type": "object",
            "description": f"the TTFT objective of each priority class ({PRIORITY_NAMES}) the autoscaler plans for "
                           "and status.sloAttainment reports against",
            "properties": {p.value: slo_class_schema(DEFAULT_SLO_CLASSES[p]) for p in Priority}}


SPEC_SCHEMA = {
    "type": "object",
    "required": ["model"],
    "x-kubernetes-validations": [RANK_RULE, STORE_RULE],
    "properties": {
        **lora_schemas(),
        "model": {"type": "string", "minLength": 1,
                  "description": "smollm2-135m-instruct, or a model directory inside the image; with runtime vllm, "
                                 "what `vllm serve` takes (a Hugging Face id or a path)"},
        "runtime": {"type": "string", "enum": list(RUNTIMES), "default": DEFAULT_RUNTIME,
                    "description": "the engine pods' server: kvfleet's engine, or vLLM (`vllm serve` with the engine "
                                   "fields as its flags, probed on /health, scaled on its metrics)"},
        # no schema default: it depends on the runtime, so the operator fills it in
        "image": {"type": "string", "description": "default: " + ", ".join(
            f"{image} ({runtime})" for runtime, image in RUNTIMES.items())},
        "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
        "engine": {"type": "object", "properties": {
            **crd_engine_properties(),
            "extraArgs": {"type": "array", "items": {"type": "string"}},
        }},
        "resources": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                      "description": "the engine container's ResourceRequirements (nvidia.com/gpu on GPU fleets)"},
        **{f.name: f.schema() for f in SPEC_FIELDS},
        "engineAuth": {
            "type": "object",
            "description": "the engines' shared token: a Secret in this namespace whose key the engine pods get as "
                           f"{ENGINE_API_KEY_ENV} (the gateway sends it); default: the operator's "
                           "--engine-api-key-secret; secretName \"\" turns it off",
            "properties": {"secretName": {"type": "string", "maxLength": 253},
                           "secretKey": {"type": "string", "minLength": 1,
                                         "default": ENGINE_API_KEY_SECRET_KEY}},
        },
        "gateway": {
            "type": "object",
            "description": "what a gateway fronting several fleets (gateway.fleets or gateway.fleetSelector in the "
                           "chart) makes of this fleet's model; the operator does not read it",
            "properties": {
                "modelAliases": {"type": "array", "maxItems": 32, "items": {
                    "type": "string", "minLength": 1, "maxLength": 256},
                    "description": "other names clients may send for spec.model"},
                "fallbackModel": {"type": "string", "minLength": 1, "maxLength": 256,
                                  "description": "the degradation ladder's second rung: while this fleet is "
                                                 "saturated, requests that allow it (x-kvfleet-allow-fallback: true, "
                                                 "or their key's allow_fallback=true) go to the fleet serving this "
                                                 "model if it has room"},
                "degradeMaxTokens": {
                    "type": "object", "description": "the ladder's first rung for this fleet: while it is "
                    "saturated, the most output tokens a request of each class named may generate (overrides the "
                    "gateway's --degrade-max-tokens)",
                    "properties": {p.value: {"type": "integer", "minimum": 1} for p in Priority}}}},
        "autoscaling": {
            "type": "object",
            "properties": {**{f.name: f.schema() for f in (AUTOSCALING_ENABLED, *AUTOSCALING_FIELDS)},
                           "sloClasses": slo_classes_schema(), "capacity": capacity_schema(),
                           "warmPool": warm_pool_schema()},
            "x-kubernetes-validations": [{"rule": "!has(self.minReplicas) || !has(self.maxReplicas) || "
                                                  "self.minReplicas <= self.maxReplicas",
                                          "message": "minReplicas must not exceed maxReplicas"}],
        },
    },
}

STATUS_SCHEMA = {
    "type": "object",
    "properties": {
        "replicas": {"type": "integer"}, "readyReplicas": {"type": "integer"},
        "observedGeneration": {"type": "integer"},
        "kvCacheUsage": {"type": "number"}, "kvCachePercent": {"type": "integer"},
        "requestsRunning": {"type": "integer"}, "requestsWaiting": {"type": "integer"},
        "gatewayQueued": {"type": "integer"}, "lastScaleTime": {"type": "string", "format": "date-time"},
        "rollingOut": {"type": "boolean", "description": "the engine Deployment has pods of an older template"},
        "warmPool": {"type": "object", "description": "the warm pool after the last period: its size, the pods "
                     "asleep, and how many the period woke and put to sleep",
                     "properties": {k: {"type": "integer"} for k in ("replicas", "asleep", "woken", "slept")}},
        "selector": {"type": "string"},
        "conditions": {"type": "array", "items": {"type": "object", "required": ["type", "status"], "properties": {
            "type": {"type": "string"}, "status": {"type": "string"}, "reason": {"type": "string"},
            "message": {"type": "string"}, "lastTransitionTime": {"type": "string", "format": "date-time"}}}},
        "scalingHistory": {"type": "array", "items": {"type": "object",
                                                      "x-kubernetes-preserve-unknown-fields": True}},
        "autoscaler": {
            "type": "object",
            "description": "the autoscaler's memory, read back every period so an operator restart changes no "
                           "decision: [time, replicas] recommendations of the stabilization windows, [time, load] "
                           "of the burst window, the burst hold's end, the last busy time (Unix seconds) and the "
                           "SLO planner's memory",
            "properties": {
                "recommendations": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "loads": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "panicUntil": {"type": "number"}, "lastBusy": {"type": "number"},
                "planner": {
                    "type": "object",
                    "description": "the SLO planner's memory: the capacity it learned (tokens/s per pod) and "
                                   "[time, work per class in pods...] demand samples (operator/planner.py)",
                    "properties": {
                        "capacity": {"type": "object", "properties": {
                            "prefillTokensPerSecond": {"type": "number"},
                            "decodeTokensPerSecond": {"type": "number"}}},
                        "demand": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        "forecast": {"type": "object", "description": "each class's forecaster (level, trend) and "
                                     "its error so far (operator/forecast.py)",
                                     "properties": {p.value: FORECAST_SCHEMA for p in Priority}}}},
                "lastDecision": {
                    "type": "object", "description": "the latest period's decision, written every period",
                    "properties": {"time": {"type": "string", "format": "date-time"}, "desired": {"type": "integer"},
                                   "reason": {"type": "string"},
                                   "inputs": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}},
        "sloAttainment": {
            "type": "object",
            "description": "per class: its objective, the share of its requests that met it over the window "
                           "(absent without answered or shed requests; a shed request is a miss), the requests that "
                           "arrived and were shed, and the seconds counted (spec.sloWindowSeconds)",
            "properties": {p.value: {"type": "object", "properties": {
                "ttftSeconds": {"type": "number"}, "tpotSeconds": {"type": "number"}, "target": {"type": "number"},
                "attained": {"type": "number", "nullable": True}, "requests": {"type": "integer"},
                "shed": {"type": "integer"}, "windowSeconds": {"type": "number"}}} for p in Priority}},
        "loraAdapters": {"type": "array", "description": "each of spec.loraAdapters: the ready pods that serve it, "
                                                      "and the engine's answer when a load failed",
                         "items": {"type": "object", "properties": {
                             "name": {"type": "string"}, "pods": {"type": "array", "items": {"type": "string"}},
                             "error": {"type": "string"}}}},
        "loraAdaptersReady": {"type": "string", "description": "adapters every ready pod serves / spec.loraAdapters"},
        "coldStartSeconds": {"type": "number", "description": f"measured pod creation to Ready: the "
                                                              f"{PERCENTILE:.0%} percentile of the fleet's last "
                                                              f"{KEEP} starts (status.coldStart)"},
        "coldStart": {"type": "object", "description": "the fleet's last pod starts, kept across operator restarts",
                      "properties": {"samples": {"type": "array", "items": {"type": "object", "properties": {
                          "pod": {"type": "string"}, "seconds": {"type": "number"}}}}}},
    },
    "x-kubernetes-preserve-unknown-fields": True,
}


def build_crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "inferencefleet", "kind": KIND, "shortNames": ["ifleet"],
                      "categories": ["kvfleet"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
                    "spec": SPEC_SCHEMA, "status": STATUS_SCHEMA}}},
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
                    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                    {"name": "KV%", "type": "integer", "jsonPath": ".status.kvCachePercent"},
                    {"name": "Queued", "type": "integer", "jsonPath": ".status.gatewayQueued"},
                    {"name": "Adapters", "type": "string", "jsonPath": ".status.loraAdaptersReady",
                     "description": "LoRA adapters every ready pod serves / the spec's"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def crd_yaml() -> str:
    import yaml

    return "# Generated by `python -m kvfleet.operator.crd`; edit operator/crd.py instead.\n" + yaml.safe_dump(
        build_crd(), sort_keys=False)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
