"""Service-level objectives per priority class, one source for their defaults, and what the gateway counts of each
class over a window: the autoscaler plans from it (demand, in requests and tokens) and the operator reports
attainment from it (InferenceFleet status.sloAttainment).

An objective is a time to first token (and optionally a time per output token) that a share of the class's requests
must meet; a class whose attainment target is 0 is best effort (sheddable by default: shed under pressure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvfleet.fleet.priority import Priority


@dataclass(frozen=True)
class SloClass:
    ttft_s: float  # time to first token, seconds, from the request reaching the gateway
    attainment: float  # the share of the class's requests that must meet it; 0: best effort
    tpot_s: float | None = None  # time per output token, seconds; None: no objective

    def __post_init__(self) -> None:
        if not (isinstance(self.ttft_s, int | float) and math.isfinite(self.ttft_s) and 0 < self.ttft_s <= 3600):
            raise ValueError(f"ttftSeconds must be a number of seconds in (0, 3600], not {self.ttft_s!r}")
        if not (isinstance(self.attainment, int | float) and 0 <= self.attainment < 1):
            raise ValueError(f"attainment must be a share in [0, 1) (0.999 is 99.9 %), not {self.attainment!r}")
        if self.tpot_s is not None and not (isinstance(self.tpot_s, int | float) and math.isfinite(self.tpot_s)
                                            and 0 < self.tpot_s <= 60):
            raise ValueError(f"tpotSeconds must be a number of seconds in (0, 60], not {self.tpot_s!r}")

    @property
    def best_effort(self) -> bool:
        return self.attainment == 0


DEFAULT_SLO_CLASSES: Mapping[Priority, SloClass] = {
    Priority.CRITICAL: SloClass(1.0, 0.999),
    Priority.STANDARD: SloClass(2.0, 0.99),
    Priority.SHEDDABLE: SloClass(5.0, 0.0),  # best effort: shed under pressure, no target to plan for
}


@dataclass(frozen=True)
class ClassWindow:
    """What the gateway replicas counted of one class over the last `window_s` seconds (all replicas together)."""

    window_s: float
    arrivals: int = 0  # requests that reached a gateway: answered, queued, refused or shed
    prompt_tokens: int = 0  # their prompt tokens (the gateway's count)
    completed: int = 0  # answered by an engine
    output_tokens: int = 0  # the completion tokens of those answers
    shed: int = 0  # refused without reaching an engine (429/503 of the queue or shedding)
    # Time to first token of the answered requests: cumulative (upper bound seconds, count) pairs, ascending,
    # the last bound inf (a Prometheus histogram's buckets).
    ttft_buckets: tuple[tuple[float, int], ...] = ()
    queued: int = 0  # waiting in the gateway queue now

    @property
    def arrivals_per_s(self) -> float:
        return self.arrivals / self.window_s if self.window_s > 0 else 0.0

    @property
    def mean_prompt_tokens(self) -> float | None:
        return self.prompt_tokens / self.arrivals if self.arrivals else None

    @property
    def mean_output_tokens(self) -> float | None:
        return self.output_tokens / self.completed if self.completed else None

    def within(self, seconds: float) -> float:
        """How many answered requests had their first token within `seconds`, interpolated linearly inside the
        bucket that holds it (as Prometheus' histogram_quantile does)."""
        below_bound, below_count = 0.0, 0
        for bound, count in self.ttft_buckets:
            if seconds < bound:
                if math.isinf(bound):
                    return float(below_count)
                return below_count + (count - below_count) * (seconds - below_bound) / (bound - below_bound)
            below_bound, below_count = bound, count
        return float(below_count)

    def attainment(self, objective: SloClass) -> float | None:
        """The share of the class's requests that met the TTFT objective, a shed request counting as a miss;
        None without requests."""
        total = self.completed + self.shed
        if total == 0:
            return None
        return min(1.0, self.within(objective.ttft_s) / total)
