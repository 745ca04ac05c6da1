"""Per-request text and stop handling: detokenizes new tokens, finds stop conditions, builds outputs."""

from __future__ import annotations

import time

from kvfleet.engine.outputs import RequestMetrics, RequestOutput
from kvfleet.engine.sampler import TokenLogprobs
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop string that overlaps the last num_new_chars characters starts, and which."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start_from = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class RequestState:
    """Everything the engine keeps about a request besides its Sequence: text so far, what was sent."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.seq = seq
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                                  seq.sampling_params.skip_special_tokens)
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0
        self.pending_logprobs: list[TokenLogprobs] = []
        # Hold back text that could be the start of a stop string until we know it is not.
        self.holdback = max((len(s) for s in seq.sampling_params.stop), default=1) - 1
        self.metrics = RequestMetrics(arrival_time=seq.arrival_time)
        self.stop_reason: str | int | None = None

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Add a sampled token and decide whether the request is now finished."""
        seq, params = self.seq, self.seq.sampling_params
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        seq.output_token_ids.append(token_id)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
        if token_id in params.stop_token_ids:
            self.finish("stop", stop_reason=token_id)
            return
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            self.finish("stop")
            return
        new_text = self.detokenizer.push([token_id])
        self.text += new_text
        if params.stop and new_text:
            found = find_stop_string(self.text, len(new_text), params.stop)
            if found is not None:
                index, stop = found
                self.text = self.text[: index + len(stop) if params.include_stop_str_in_output else index]
                self.finish("stop", stop_reason=found[1])
                return
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish("length")

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None) -> None:
        if not isinstance(stop_reason, str) and reason != "error":  # a stop string already cut the text
            try:
                self.text += self.detokenizer.flush()  # emit held-back bytes
            except Exception:  # noqa: BLE001 - this request's fault alone; it ends as an error
                reason, error = "error", "the engine failed while turning this request's tokens into text"
        self.seq.finish_reason = reason
        self.seq.error = error
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.seq.finish_reason is not None

    def make_output(self) -> RequestOutput:
        """The delta since the last output; unfinished requests hold back a possible partial stop string."""
        seq = self.seq
        end = len(self.text) if self.finished else max(self.sent_chars, len(self.text) - self.holdback)
        delta = self.text[self.sent_chars:end]
        self.sent_chars = end
        new_tokens = seq.output_token_ids[self.sent_tokens:]
        self.sent_tokens = len(seq.output_token_ids)
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.metrics.num_cached_tokens = seq.num_cached_tokens
        self.metrics.num_preemptions = seq.num_preemptions
        self.metrics.first_scheduled_time = seq.first_scheduled_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_tokens,
            num_output_tokens=len(seq.output_token_ids),
            text_delta=delta,
            text=self.text[:end],
            finished=self.finished,
            finish_reason=seq.finish_reason,
            stop_reason=self.stop_reason,
            error=seq.error,
            logprobs=logprobs,
            metrics=self.metrics,
        )
