"""Decode tokens/s at a full batch, learned from the engine's own decode steps: the autoscaler's capacity model
reads it (kvfleet_decode_tokens_per_second_full_batch) to plan in tokens rather than in requests.

A decode step's time grows about linearly with the sequences in it (weights read once, plus per-sequence attention
and sampling): step = a + b × batch. Fitted over the recent step time of each batch size seen, the full batch
gives max_num_seqs / (a + b × max_num_seqs) tokens/s. Until two batch sizes have been seen there is no line: 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new step in its batch size's moving average
MAX_WEIGHT = 32  # a batch size seen often counts up to this many times in the fit, so rare sizes still move it
REFIT_EVERY = 16  # steps between fits (a fit over 256 batch sizes costs ~0.2 ms), and at each new batch size


def fit_line(points: list[tuple[int, float, int]]) -> tuple[float, float] | None:
    """(a, b) of seconds = a + b × batch by weighted least squares over (batch, seconds, weight); None with fewer
    than two batch sizes. A negative slope (noise: a step does not get faster with more sequences) becomes a flat
    line at the weighted mean."""
    if len({batch for batch, _, _ in points}) < 2:
        return None
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / var
    if slope < 0:
        return mean_y, 0.0
    return mean_y - slope * mean_x, slope


def full_batch_tokens_per_s(line: tuple[float, float] | None, max_num_seqs: int) -> float:
    """Decode tokens/s at a batch of max_num_seqs on `line`; 0 without a line or where it gives no positive time."""
    if line is None or max_num_seqs <= 0:
        return 0.0
    a, b = line
    seconds = a + b * max_num_seqs
    return max_num_seqs / seconds if seconds > 0 else 0.0


@dataclass
class DecodeStepFit:
    """The recent decode step time of each batch size, and the full-batch rate fitted over them. add() runs on the
    engine thread after each decode-only step; `tokens_per_s` is a float, so readers on other threads see either
    the old or the new figure."""

    max_num_seqs: int
    step_seconds: dict[int, float] = field(default_factory=dict)  # batch size -> moving average
    steps: dict[int, int] = field(default_factory=dict)  # batch size -> steps seen
    tokens_per_s: float = 0.0  # 0 until two batch sizes have been seen
    per_sequence_s: float = 0.0  # the fitted line's slope: what one more decoding sequence adds to a step
    added: int = 0

    def add(self, batch: int, seconds: float) -> None:
        if batch <= 0 or not seconds > 0:
            return
        old = self.step_seconds.get(batch)
        self.step_seconds[batch] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds
        self.steps[batch] = self.steps.get(batch, 0) + 1
        self.added += 1
        if old is None or self.added % REFIT_EVERY == 0:
            self.refit()

    def refit(self) -> None:
        points = [(x, y, min(self.steps[x], MAX_WEIGHT)) for x, y in self.step_seconds.items()]
        line = fit_line(points)
        self.tokens_per_s = full_batch_tokens_per_s(line, self.max_num_seqs)
        self.per_sequence_s = line[1] if line else 0.0
