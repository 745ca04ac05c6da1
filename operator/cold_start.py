"""A fleet's cold start, measured: pod creation to Ready of its engine pods, the autoscaler's planning horizon
(Observation.cold_start_s). Pure: the pods come in as the API's dicts, the samples go out to status.coldStart, so
a restarted operator keeps them.

The figure is a high percentile of the last starts, not their mean: the autoscaler must plan for a slow start (a
cold node, an image pull), and one odd start should not move it far either way.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping
from typing import Any

KEEP = 20  # starts remembered per fleet
PERCENTILE = 0.9
MAX_START_S = 3600.0  # a longer "start" is a pod that was unready for a while later on, not a start


def _time(value: Any) -> datetime.datetime | None:
    """An API timestamp (datetime from the client, or RFC 3339 text from a raw object); None when absent or bad."""
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return None


def pod_start(pod: Mapping[str, Any]) -> tuple[str, float] | None:
    """(pod uid or name, seconds from creation to Ready) for a pod that became Ready and has not restarted a
    container since (its Ready time would then be the restart's); None for any other pod."""
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True" or metadata.get("deletionTimestamp"):
        return None
    if any((c.get("restartCount") or 0) > 0 for c in status.get("containerStatuses") or []):
        return None
    created, ready_at = _time(metadata.get("creationTimestamp")), _time(ready.get("lastTransitionTime"))
    key = metadata.get("uid") or metadata.get("name")
    if created is None or ready_at is None or not key:
        return None
    seconds = (ready_at - created).total_seconds()
    return (str(key), seconds) if 0 <= seconds <= MAX_START_S else None


def saved_samples(saved: Any) -> list[tuple[str, float]]:
    """status.coldStart.samples read back; anything malformed is dropped (the next starts refill it)."""
    samples = (saved or {}).get("samples") if isinstance(saved, Mapping) else None
    out = []
    for item in samples if isinstance(samples, list) else []:
        try:
            key, seconds = item["pod"], float(item["seconds"])
        except (TypeError, ValueError, KeyError):
            continue
        if isinstance(key, str) and math.isfinite(seconds) and 0 <= seconds <= MAX_START_S:
            out.append((key, seconds))
    return out[-KEEP:]


def add_starts(samples: list[tuple[str, float]], pods: Iterable[Mapping[str, Any]]) -> list[tuple[str, float]]:
    """The remembered starts with those of pods not seen before, oldest first, at most KEEP."""
    seen = {key for key, _ in samples}
    new = [s for s in map(pod_start, pods) if s is not None and s[0] not in seen]
    return [*samples, *new][-KEEP:]


def cold_start_figure(samples: list[tuple[str, float]]) -> float | None:
    """The PERCENTILE start time (nearest rank) of the samples; None without any."""
    if not samples:
        return None
    ordered = sorted(seconds for _, seconds in samples)
    return ordered[min(len(ordered) - 1, math.ceil(PERCENTILE * len(ordered)) - 1)]


def cold_start_status(samples: list[tuple[str, float]]) -> dict[str, Any]:
    """status.coldStart: the samples, so that a restarted operator keeps the figure."""
    return {"samples": [{"pod": key, "seconds": round(seconds, 3)} for key, seconds in samples]}
