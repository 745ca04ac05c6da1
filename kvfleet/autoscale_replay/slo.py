"""The objectives a replay scores against: a TTFT objective and an attainment target per priority class, and the
score of one run (attainment, replica-seconds, shed) that every policy's JSON carries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet.autoscale_replay.fleet import Run
from kvfleet.fleet.priority import PRIORITY_NAMES, Priority

DEFAULT_TTFT_S = {Priority.CRITICAL: 1.0, Priority.STANDARD: 2.0, Priority.SHEDDABLE: 5.0}
# sheddable is best effort: shed under pressure, no target the oracle must meet
DEFAULT_ATTAINMENT = {Priority.CRITICAL: 0.999, Priority.STANDARD: 0.99, Priority.SHEDDABLE: 0.0}


@dataclass(frozen=True)
class Slo:
    ttft_s: dict[Priority, float] = field(default_factory=lambda: dict(DEFAULT_TTFT_S))
    attainment: dict[Priority, float] = field(default_factory=lambda: dict(DEFAULT_ATTAINMENT))

    def __post_init__(self) -> None:
        for p in Priority:
            if not (math.isfinite(self.ttft_s[p]) and self.ttft_s[p] > 0):
                raise ValueError(f"the TTFT objective of {p.value} must be a positive number of seconds")
            if not 0 <= self.attainment[p] <= 1:
                raise ValueError(f"the attainment target of {p.value} must be between 0 and 1")

    def met(self, attainment: dict[Priority, float | None]) -> bool:
        """Whether every class with requests reaches its target."""
        return all(a is None or a >= self.attainment[p] - 1e-12 for p, a in attainment.items())


def parse_classes(text: str, option: str, defaults: dict[Priority, float]) -> dict[Priority, float]:
    """'critical=1,standard=2' over the defaults; a ValueError naming the option and what to write."""
    values = dict(defaults)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, number = item.partition("=")
        try:
            priority, value = Priority(name.strip().lower()), float(number)
        except ValueError:
            raise ValueError(f"{option}: {item!r} is not CLASS=NUMBER with CLASS one of {PRIORITY_NAMES}, e.g. "
                             f"{option} critical=1,standard=2") from None
        values[priority] = value
    return values


def attainment(run: Run, slo: Slo) -> dict[Priority, float | None]:
    """Per class, the share of its requests whose first token came within its TTFT objective (a shed request, or
    one without a first token when the simulation stopped, misses); None for a class without requests."""
    met, total = dict.fromkeys(Priority, 0), dict.fromkeys(Priority, 0)
    for r in run.requests:
        total[r.priority] += 1
        if r.first_token is not None and r.first_token - r.arrival <= slo.ttft_s[r.priority]:
            met[r.priority] += 1
    return {p: met[p] / total[p] if total[p] else None for p in Priority}


def feasible(run: Run, slo: Slo) -> tuple[dict[Priority, float | None], dict[Priority, float | None]]:
    """Per class: the share of its requests any policy could serve in time (their prefill alone fits the
    objective: a pod free the moment they arrive), and the share of those that were served in time. The misses of
    the rest are the trace's, not the policy's."""
    possible, met = dict.fromkeys(Priority, 0), dict.fromkeys(Priority, 0)
    total = dict.fromkeys(Priority, 0)
    for r in run.requests:
        total[r.priority] += 1
        if r.prefill_s <= slo.ttft_s[r.priority]:
            possible[r.priority] += 1
            met[r.priority] += r.first_token is not None and r.first_token - r.arrival <= slo.ttft_s[r.priority]
    return ({p: possible[p] / total[p] if total[p] else None for p in Priority},
            {p: met[p] / possible[p] if possible[p] else None for p in Priority})


def score(run: Run, slo: Slo) -> dict:
    """The documented shape: slo_attainment and shed per class, replica_seconds (every pod that costs, each
    second of the trace, asleep ones included) and, of those, asleep_replica_seconds (the warm pool's); beside them
    the requests per class."""
    shed = dict.fromkeys(Priority, 0)
    requests = dict.fromkeys(Priority, 0)
    for r in run.requests:
        requests[r.priority] += 1
        shed[r.priority] += r.shed
    share, among = feasible(run, slo)
    return {"slo_attainment": {p.value: a for p, a in attainment(run, slo).items()},
            "feasible": {p.value: v for p, v in share.items()},
            "feasible_attainment": {p.value: v for p, v in among.items()},
            "replica_seconds": sum(run.pods), "asleep_replica_seconds": sum(run.asleep),
            "shed": {p.value: n for p, n in shed.items()},
            "requests": {p.value: n for p, n in requests.items()}} | ({"batch": run.batch} if run.batch else {})
