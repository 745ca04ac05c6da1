"""One simulated engine: continuous batching by a step-time model, and the engine's real prefix cache.

Each step admits waiting requests while batch slots, the token budget and free KV blocks allow (a prompt longer than
the budget takes a step of its own: chunked prefill folded into one step), then lasts the calibrated decode step of
the requests already decoding plus the admitted prompts' uncached tokens over the prefill rate. Hits, evictions and
the KV events come from engine/block_manager.py itself, driven with real Sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bench.prefix_sim.calibrate import Calibration
from bench.prefix_sim.workload import Arrival
from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence
from kvfleet.fleet.kv_events import KVEvent

_PARAMS = SamplingParams(max_tokens=1)  # never read: the simulation counts output tokens itself


@dataclass(frozen=True)
class EngineShape:
    num_blocks: int = 4096  # KV budget per engine (64k tokens): ~60 of 1,000 tenants' prefixes, not all
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError("num_blocks, block_size, max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(slots=True)
class Job:
    """A request in the simulation, from its arrival at a gateway replica to its last token."""

    arrival: Arrival
    seq: Sequence
    engine: int = -1
    hit_tokens: int = 0
    decoded: int = 0
    dispatched_at: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    meta: dict = field(default_factory=dict)


class SimEngine:
    def __init__(self, index: int, shape: EngineShape, calibration: Calibration, events: bool) -> None:
        self.index, self.url, self.shape, self.calibration = index, f"http://engine-{index}:8000", shape, calibration
        self.blocks = BlockManager(shape.num_blocks, shape.block_size)
        self.blocks.events = [] if events else None
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.admitted: list[Job] = []  # prefilling in the current step
        self.waiting_tokens = 0
        self.step_prefill_tokens = 0
        self.busy = False
        self.event_log: list[tuple[float, list[KVEvent]]] = []  # (published at, events); replicas read with a delay
        self.log_base = 0  # events trimmed from the log's front (read by every replica)
        self.events_published = 0
        self.blocks_published = 0

    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.waiting_tokens += job.seq.num_prompt_tokens

    def start_step(self) -> float | None:
        """Admit what fits and return the step's duration; None when there is nothing to do (the engine idles)."""
        budget = self.shape.max_num_batched_tokens - len(self.running)
        prefill = 0
        while self.waiting and len(self.running) + len(self.admitted) < self.shape.max_num_seqs:
            job = self.waiting[0]
            seq = job.seq
            cached = self.blocks.find_cached_prefix(seq)
            hit = self.blocks.cached_prefix_tokens(cached)
            new = seq.num_prompt_tokens - hit
            if (new > budget and self.admitted) or not self.blocks.can_allocate(
                    seq, new + job.arrival.output_tokens, cached):
                break
            self.waiting.popleft()
            self.waiting_tokens -= seq.num_prompt_tokens
            self.blocks.allocate(seq, new + job.arrival.output_tokens, cached)
            self.blocks.record_prefix_lookup(seq.num_prompt_tokens, hit)
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.blocks.cache_full_blocks(seq)
            job.hit_tokens = hit
            self.admitted.append(job)
            budget -= new
            prefill += new
        if not self.admitted and not self.running:
            self.busy = False
            return None
        self.busy = True
        self.step_prefill_tokens = prefill
        decode_s = self.calibration.step_s(len(self.running)) if self.running else 0.0
        return decode_s + prefill / self.calibration.prefill_tokens_per_s

    def finish_step(self, now: float) -> list[Job]:
        """The step's tokens are out at `now`: first tokens of the admitted, one more of each decoding request; the
        finished requests (their blocks freed) are returned."""
        done: list[Job] = []
        still: list[Job] = []
        for job in self.running:
            job.decoded += 1
            (done if job.decoded >= job.arrival.output_tokens else still).append(job)
        for job in self.admitted:
            job.first_token, job.decoded = now, 1
            (done if job.decoded >= job.arrival.output_tokens else still).append(job)
        self.running, self.admitted, self.step_prefill_tokens = still, [], 0
        for job in done:
            job.finished = now
            self.blocks.free(job.seq)
        if self.blocks.events:
            events = self.blocks.take_events()
            self.events_published += len(events)
            self.blocks_published += sum(len(getattr(e, "block_hashes", ())) for e in events)
            self.event_log.append((now, events))
        return done

    def prefill_tokens_pending(self) -> int:
        return self.waiting_tokens + self.step_prefill_tokens

    def trim_log(self, read_upto: int) -> None:
        """Drop the events every reader has taken (read_upto: the least absolute position read)."""
        drop = read_upto - self.log_base
        if drop > 1024:
            del self.event_log[:drop]
            self.log_base = read_upto


def new_sequence(arrival: Arrival) -> Sequence:
    return Sequence(str(arrival.rid), list(arrival.token_ids), _PARAMS, arrival_time=arrival.at,
                    arrival_order=arrival.rid)
