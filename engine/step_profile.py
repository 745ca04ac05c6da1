"""Where a step's time goes, outside the model and in it: per kind of step (with prefill, or decode-only by batch
size) the seconds in each phase. The engine fills one when asked (`LLMEngine.profile`); bench/engine_throughput.py
prints it. Each phase costs two clock reads a step."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

# schedule: the scheduler's plan; prepare: the batch's input tensors; model: the forward pass and the logits;
# sample: the sampler; outputs: detokenizing, stop checks and each request's output
PHASES = ("schedule", "prepare", "model", "sample", "outputs")
SMALL_DECODE = 16  # decode batches below this stream all weights for a handful of tokens


def step_kind(scheduled: list[tuple[object, int]]) -> str:
    """'prefill' (the step computes prompt tokens), 'decode<16' or 'decode>=16'."""
    if any(n != 1 for _, n in scheduled):
        return "prefill"
    return f"decode<{SMALL_DECODE}" if len(scheduled) < SMALL_DECODE else f"decode>={SMALL_DECODE}"


@dataclass
class StepProfile:
    seconds: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(PHASES,
                                                                                                          0.0)))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, phases: dict[str, float]) -> None:
        self.steps[kind] += 1
        into = self.seconds[kind]
        for phase, seconds in phases.items():
            into[phase] += seconds

    def summary(self) -> dict:
        """Per kind: steps, seconds, its share of all step time, and each phase's share of its time; then the share
        of all step time spent outside the model (every phase but `model`)."""
        total = sum(sum(p.values()) for p in self.seconds.values()) or 1.0
        kinds = {}
        for kind, phases in sorted(self.seconds.items()):
            spent = sum(phases.values()) or 1.0
            kinds[kind] = {"steps": self.steps[kind], "seconds": sum(phases.values()),
                           "share": sum(phases.values()) / total,
                           "phases": {p: phases[p] / spent for p in PHASES}}
        outside = sum(p[ph] for p in self.seconds.values() for ph in PHASES if ph != "model")
        return {"kinds": kinds, "outside_model_share": outside / total, "total_s": total}

    def table(self) -> str:
        s = self.summary()
        rows = [f"{'step kind':<12} {'steps':>6} {'seconds':>8} {'share':>6}  " + " ".join(f"{p:>9}" for p in PHASES)]
        for kind, k in s["kinds"].items():
            rows.append(f"{kind:<12} {k['steps']:>6} {k['seconds']:>8.2f} {k['share']:>6.1%}  "
                        + " ".join(f"{k['phases'][p]:>9.1%}" for p in PHASES))
        rows.append(f"outside the model: {s['outside_model_share']:.1%} of {s['total_s']:.1f} s of steps")
        return "\n".join(rows)
