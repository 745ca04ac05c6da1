"""The Table answers a Kubernetes API server gives `kubectl get` (pure), for the local API emulator: the
InferenceFleet's printer columns from its CRD (MODEL REPLICAS READY KV% QUEUED AGE) and the Pod columns."""

from __future__ import annotations

import datetime
from typing import Any

TABLE_ACCEPT = "as=Table"


def wants_table(accept: str) -> bool:
    """kubectl asks `application/json;as=Table;v=v1;g=meta.k8s.io, application/json`."""
    return TABLE_ACCEPT in accept and "g=meta.k8s.io" in accept


def human_age(seconds: float) -> str:
    """Kubernetes' HumanDuration, as `kubectl get` prints AGE: 45s, 3m20s, 12m, 5h3m, 3d..."""
    s = max(0, int(seconds))
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{days}d"


def age(obj: dict, now: datetime.datetime) -> str:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    try:
        created = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    return human_age((now - created).total_seconds())


def json_path(obj: Any, path: str) -> Any:
    """The simple `.a.b.c` paths printer columns use; None where a field is missing."""
    for key in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _table(columns: list[tuple[str, str]], rows: list[tuple[dict, list]]) -> dict:
    return {"apiVersion": "meta.k8s.io/v1", "kind": "Table", "metadata": {"resourceVersion": "1"},
            "columnDefinitions": [{"name": name, "type": kind, "format": "name" if name == "Name" else "",
                                   "description": "", "priority": 0} for name, kind in columns],
            "rows": [{"cells": cells, "object": {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                                                 "metadata": obj.get("metadata") or {}}} for obj, cells in rows]}


def printer_columns_table(objs: list[dict], columns: list[dict], now: datetime.datetime) -> dict:
    """What the API server answers for a custom resource: Name, then the CRD's additionalPrinterColumns."""
    def cell(obj: dict, column: dict) -> Any:
        if column["type"] == "date":
            return age(obj, now)
        return json_path(obj, column["jsonPath"])

    return _table([("Name", "string"), *((c["name"], c["type"]) for c in columns)],
                  [(o, [o["metadata"]["name"], *(cell(o, c) for c in columns)]) for o in objs])


def pods_table(pods: list[dict], now: datetime.datetime) -> dict:
    """NAME READY STATUS RESTARTS AGE, from the fields the local kubelet writes."""
    rows = []
    for pod in pods:
        containers = len((pod.get("spec") or {}).get("containers") or []) or 1
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        phase = (pod.get("metadata") or {}).get("deletionTimestamp") and "Terminating" or \
            (pod.get("status") or {}).get("phase") or "Pending"
        rows.append((pod, [pod["metadata"]["name"], f"{containers if ready else 0}/{containers}", phase, 0,
                           age(pod, now)]))
    return _table([("Name", "string"), ("Ready", "string"), ("Status", "string"), ("Restarts", "integer"),
                   ("Age", "string")], rows)
