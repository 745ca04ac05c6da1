"""One request's tokens, progress and KV blocks as the scheduler sees them."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from kvfleet.engine.lora_registry import LoraSpec
from kvfleet.engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request in flight: its tokens, how many have KV computed, and the blocks that hold them.

    The scheduler's one rule: each step, `num_computed_tokens` catches up with `num_tokens`
    within the token budget. Prefill, chunked prefill, decode and recompute after
    preemption all follow from it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    lora: LoraSpec | None = None  # the adapter this request runs with (None: the base model)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain over full blocks, grown lazily
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    error: str | None = None
    passed_by: int = 0  # requests admitted ahead of it while the --max-loras cap held it back (scheduler.py)

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed % 2**64)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def num_new_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower priority value first, then first come first served (vLLM's priority policy)."""
        return (self.priority, self.arrival_order)
