"""The engine's step-time model, measured: prefill tokens/s on a 512-token prompt and the decode step time at batch
1..16, with the real LLMEngine on smollm2-135m-instruct (CPU here; `--calibration FILE` takes GPU figures instead).

    python -m bench.prefix_sim.calibrate --out bench/results/prefix_sim_calibration.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Measured on this machine (2 CPU cores, quiet at the time: load average ~1) with
# `python -m bench.prefix_sim.calibrate --threads 2` on 2026-11-25: prefill 730 tokens/s on a 512-token prompt (best of
# 4; a second run gave 663), decode steps (fastest of 16) 36.7, 39.9, 36.5, 40.6, 50.8 ms at batch 1, 2, 4, 8, 16; the
# steps below are the least-squares line through those, 35.4 ms + 0.9 ms a sequence (raw run:
# bench/results/prefix_sim_calibration.json). Under other benchmarks' load (load average ~6) the same script measured
# 2-6x slower and erratic figures, so re-measure on a quiet machine or pass GPU figures with --calibration.
MEASURED_PREFILL_TOKENS_PER_S = 730.0
MEASURED_DECODE_STEP_S = {1: 0.0363, 2: 0.0372, 4: 0.0390, 8: 0.0425, 16: 0.0496}


@dataclass(frozen=True)
class Calibration:
    """One engine's speed: prompt tokens per second of prefill, and a decode step's seconds by batch size
    (interpolated linearly between measured sizes, extrapolated from the last two beyond them)."""

    prefill_tokens_per_s: float = MEASURED_PREFILL_TOKENS_PER_S
    decode_step_s: dict[int, float] = field(default_factory=lambda: dict(MEASURED_DECODE_STEP_S))
    source: str = "smollm2-135m-instruct, LLMEngine, 2 CPU threads (bench/prefix_sim/calibrate.py)"

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or not self.decode_step_s:
            raise ValueError("a calibration needs a positive prefill_tokens_per_s and at least one decode step time")
        if any(b < 1 or s <= 0 for b, s in self.decode_step_s.items()):
            raise ValueError("decode_step_s maps batch sizes >= 1 to positive seconds")
        object.__setattr__(self, "decode_step_s", {int(b): float(s) for b, s in sorted(self.decode_step_s.items())})

    def step_s(self, batch: int) -> float:
        """Seconds of one decode step over `batch` running sequences."""
        points = list(self.decode_step_s.items())
        if batch <= points[0][0] or len(points) == 1:
            size, seconds = points[0]
            return seconds * max(1.0, batch / size)
        (low, t_low), (high, t_high) = next(((a, b) for a, b in zip(points, points[1:], strict=False)
                                             if batch <= b[0]), points[-2:])
        return t_low + (t_high - t_low) * (batch - low) / (high - low)

    @staticmethod
    def load(path: Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        return Calibration(float(data["prefill_tokens_per_s"]),
                           {int(b): float(s) for b, s in data["decode_step_s"].items()},
                           str(data.get("source", path)))


def measure(prompt_tokens: int = 512, batches: tuple[int, ...] = (1, 2, 4, 8, 16), steps: int = 16) -> Calibration:
    """Time the real engine: prefill of one prompt (best of 3 after a warm-up), then decode steps at each batch
    size (the fastest of `steps`)."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine
    from kvfleet.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(2048, prompt_tokens),
                                    enable_prefix_caching=False, kv_events=False), show_progress=False)
    prefill = []
    for k in range(5):
        ids = [(7 * k + 13 * i) % 40000 + 100 for i in range(prompt_tokens)]
        engine.add_request(f"p{k}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill.append(prompt_tokens / (time.perf_counter() - started))
    decode: dict[int, float] = {}
    for batch in batches:
        for k in range(batch):
            engine.add_request(f"d{batch}-{k}", [100 + k] * 32,
                               SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill step
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        while engine.has_unfinished_requests():
            engine.step()
        decode[batch] = min(times)  # the machine is shared: the fastest step is the least disturbed one
    return Calibration(max(prefill[1:]), decode)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_sim.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_sim_calibration.json"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine's default on this machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    calibration = measure()
    data = {**asdict(calibration), "decode_step_s": {str(b): s for b, s in calibration.decode_step_s.items()},
            "wall_s": round(time.monotonic() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
