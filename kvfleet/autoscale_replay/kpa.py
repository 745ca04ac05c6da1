"""Knative's Knative Pod Autoscaler (KPA) on concurrency, as its docs describe it:

- desired pods = ceil(observed concurrency / (target × target utilization)); concurrency is in-flight requests,
  here those in the pods and those the gateway holds (Knative's activator buffers them the same way);
- the observed concurrency is the average over the 60 s stable window, or over the 6 s panic window
  (panic-window-percentage 10 %) in panic mode;
- panic mode starts when the panic window's desired pods reach 2× the ready pods (panic-threshold-percentage
  200 %), and ends once the stable window has passed without that condition; in panic the pod count never goes
  down;
- at most max-scale-up-rate 1000× up and max-scale-down-rate 2× down per decision, every 2 s (the tick).

Sources: knative.dev/docs/serving/autoscaling/kpa-specific/ (stable and panic windows, panic threshold, scale
rates), .../autoscaling/concurrency/ (target and target utilization, default 70 %). The target here is the
engine's batch (max_num_seqs): a pod's natural concurrency, 70 % of it being the utilization Knative aims at. The
floor is one pod (minScale 1), as for the other reactive policies here; Knative's default would scale to zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.autoscale_replay.fleet import FleetView

TICK_S = 2


@dataclass
class KpaPolicy:
    target: float  # concurrency per pod
    min_replicas: int = 1
    max_replicas: int = 64
    target_utilization: float = 0.7
    stable_window_s: int = 60
    panic_window_s: int = 6
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    panic_since: float | None = None  # when panic mode began; None outside it
    last_panic_condition: float = -math.inf

    def desired(self, view: FleetView) -> int:
        history = view.concurrency or (0,)
        per_pod = self.target * self.target_utilization
        stable = sum(history[-self.stable_window_s:]) / len(history[-self.stable_window_s:])
        panic = sum(history[-self.panic_window_s:]) / len(history[-self.panic_window_s:])
        ready = max(1, len(view.pods))
        want_stable, want_panic = math.ceil(stable / per_pod), math.ceil(panic / per_pod)
        if want_panic / ready >= self.panic_threshold:
            self.last_panic_condition = view.time
            if self.panic_since is None:
                self.panic_since = view.time
        elif self.panic_since is not None and view.time - self.last_panic_condition >= self.stable_window_s:
            self.panic_since = None
        current = view.replicas
        wanted = want_panic if self.panic_since is not None else want_stable
        if self.panic_since is not None:
            wanted = max(wanted, current)  # in panic the pod count never goes down
        if current:
            wanted = min(wanted, math.ceil(current * self.max_scale_up_rate))
            wanted = max(wanted, math.floor(current / self.max_scale_down_rate))
        return min(self.max_replicas, max(self.min_replicas, wanted))
