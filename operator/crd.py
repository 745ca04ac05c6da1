"""The InferenceFleet CustomResourceDefinition, built in one place (the chart's crds/ file is generated from it:
`python -m kvfleet.operator.crd > charts/kvfleet/crds/inferencefleets.kvfleet.io.yaml`, and a test checks it)."""

from __future__ import annotations

import sys

from kvfleet.operator.fleet_spec import GROUP, KIND, PLURAL, VERSION


def _int(minimum: int, maximum: int, default: int | None = None, description: str = "") -> dict:
    out: dict = {"type": "integer", "minimum": minimum, "maximum": maximum}
    if default is not None:
        out["default"] = default
    if description:
        out["description"] = description
    return out


def _num(minimum: float, maximum: float, default: float, description: str = "") -> dict:
    out: dict = {"type": "number", "minimum": minimum, "maximum": maximum, "default": default}
    if description:
        out["description"] = description
    return out


SPEC_SCHEMA = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string", "minLength": 1,
                  "description": "smollm2-135m-instruct, or a model directory inside the image"},
        "image": {"type": "string", "default": "kvfleet/engine:cpu"},
        "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
        "engine": {"type": "object", "properties": {
            "maxModelLen": _int(16, 1 << 20, 2048),
            "maxNumSeqs": _int(1, 4096, 128),
            "blockSize": _int(1, 1024, 16),
            "kvCacheMemory": {"x-kubernetes-int-or-string": True,
                              "description": "KV cache size on CPU, e.g. 1Gi"},
            "gpuMemoryUtilization": {"type": "number", "minimum": 0.05, "maximum": 1.0},
            "extraArgs": {"type": "array", "items": {"type": "string"}},
        }},
        "resources": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                      "description": "the engine container's ResourceRequirements (nvidia.com/gpu on GPU fleets)"},
        "replicas": _int(0, 1000, 1, "engine pods; the autoscaler writes it when autoscaling is enabled"),
        "drainSeconds": _int(0, 3600, 30, "how long an engine may finish in-flight requests when stopped"),
        "engineAuth": {
            "type": "object",
            "description": "the engines' shared token: a Secret in this namespace whose key the engine pods get as "
                           "KVFLEET_ENGINE_API_KEY (the gateway sends it); default: the operator's "
                           "--engine-api-key-secret; secretName \"\" turns it off",
            "properties": {"secretName": {"type": "string", "maxLength": 253},
                           "secretKey": {"type": "string", "minLength": 1, "default": "api-key"}},
        },
        "autoscaling": {
            "type": "object",
            "properties": {
                "enabled": {"type": "boolean", "default": False},
                "minReplicas": _int(0, 1000, 1, "0 lets an idle fleet scale to zero"),
                "maxReplicas": _int(1, 1000, 8),
                "targetKVCacheUsage": _num(0.01, 1.0, 0.7),
                "targetQueuePerReplica": _num(0.1, 1e6, 4.0),
                "tolerance": _num(0.0, 0.99, 0.1),
                "scaleUpStabilizationSeconds": _int(0, 3600, 0),
                "scaleDownStabilizationSeconds": _int(0, 3600, 300),
                "scaleToZeroAfterSeconds": _int(0, 86400, 300),
            },
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
