"""The InferenceFleet CustomResourceDefinition, built in one place (the chart's crds/ file is generated from it:
`python -m kvfleet.operator.crd > charts/kvfleet/crds/inferencefleets.kvfleet.io.yaml`, and a test checks it)."""

from __future__ import annotations

import sys

from kvfleet.fleet.engine_settings import crd_engine_properties
from kvfleet.operator.fleet_fields import AUTOSCALING_ENABLED, AUTOSCALING_FIELDS, DEFAULT_IMAGE, SPEC_FIELDS
from kvfleet.operator.fleet_spec import (
    ENGINE_API_KEY_ENV,
    ENGINE_API_KEY_SECRET_KEY,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
)

SPEC_SCHEMA = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string", "minLength": 1,
                  "description": "smollm2-135m-instruct, or a model directory inside the image"},
        "image": {"type": "string", "default": DEFAULT_IMAGE},
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
        "autoscaling": {
            "type": "object",
            "properties": {f.name: f.schema() for f in (AUTOSCALING_ENABLED, *AUTOSCALING_FIELDS)},
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
                           "of the burst window, the burst hold's end and the last busy time (Unix seconds)",
            "properties": {
                "recommendations": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "loads": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "panicUntil": {"type": "number"}, "lastBusy": {"type": "number"}}},
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
