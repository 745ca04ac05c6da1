"""spec.autoscaling.warmPool as the operator reads it and the CRD declares it (the pool itself: warm_pool.py)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_POOL = 100
DEFAULT_WAKE_S = 5.0  # what the autoscaler plans with unless the spec says otherwise


class InvalidWarmPool(ValueError):
    """The message names the field to fix."""


@dataclass(frozen=True)
class WarmPool:
    replicas: int = 0
    wake_s: float = DEFAULT_WAKE_S


def parse_warm_pool(auto: dict, runtime: str) -> WarmPool | None:
    """spec.autoscaling.warmPool, or None when absent or of 0 replicas; InvalidWarmPool names the field to fix."""
    given = auto.get("warmPool")
    if given is None:
        return None
    where = "spec.autoscaling.warmPool"
    if not isinstance(given, dict):
        raise InvalidWarmPool(f"{where} must be an object such as {{replicas: 2, wakeSeconds: 5}}, not {given!r}")
    unknown = sorted(set(given) - {"replicas", "wakeSeconds"})
    if unknown:
        raise InvalidWarmPool(f"{where}.{unknown[0][:60]} is not a field: set replicas and wakeSeconds")
    replicas = given.get("replicas", 0)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_POOL:
        raise InvalidWarmPool(f"{where}.replicas must be an integer from 0 to {MAX_POOL}, not {replicas!r}")
    wake = given.get("wakeSeconds", DEFAULT_WAKE_S)
    if isinstance(wake, bool) or not isinstance(wake, int | float) or not 0 <= wake <= 600:
        raise InvalidWarmPool(f"{where}.wakeSeconds must be a number from 0 to 600, not {wake!r}")
    if replicas and runtime != "kvfleet":
        raise InvalidWarmPool(f"{where} needs runtime kvfleet: a vLLM server answers /health while asleep, so "
                              "Kubernetes would keep sending it requests (and its sleep mode needs a GPU)")
    return WarmPool(replicas, float(wake)) if replicas else None


def schema() -> dict:
    return {"type": "object", "description": "replicas kept asleep with the model loaded (the engines' sleep mode, "
            "KV cache released), woken first when the autoscaler scales up; the Deployment runs replicas + "
            "warmPool.replicas pods (runtime kvfleet)",
            "properties": {"replicas": {"type": "integer", "minimum": 0, "maximum": MAX_POOL, "default": 0},
                           "wakeSeconds": {"type": "number", "minimum": 0, "maximum": 600,
                                           "default": DEFAULT_WAKE_S,
                                           "description": "asleep to serving: what the autoscaler plans with"}}}


