"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.engine.sampler import TokenLogprobs


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """A request's progress: the tokens and text new since the last output, and the totals so far."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    num_output_tokens: int
    text_delta: str
    text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    metrics: RequestMetrics | None = None
