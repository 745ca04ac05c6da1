"""One engine pod as the replay simulates it, calibrated from the engine benchmark (SmolLM2-135M on 2 CPU cores:
64 requests of the Anyscale shape in 52.8 s, i.e. 1.2 requests/s at a full batch of 64, prefill included).

A pod runs up to max_num_seqs requests at once with processor-shared decode whose throughput grows with the batch
(half its asymptote at 25 sequences, from the step-time split), prefills one prompt at a time (~480 tokens/s)
while decoding pauses, and takes both its waiting requests and the prompts still to prefill by engine priority
(critical first, as the engine's scheduler does). A request that outranks a running one does not wait for a slot:
the lowest-priority, latest-arrived running request is preempted and recomputed later (vLLM's priority policy, as
the engine's scheduler does). It reports KV usage = running × a per-request share; a request whose prefill has not
started counts as waiting; and the capacity the engine measures of itself (prefill tokens/s, decode tokens/s at a
full batch).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from functools import cached_property

from kvfleet.fleet.priority import BATCH_ENGINE_PRIORITY, Priority, engine_priority
from kvfleet.operator.autoscaler import PodLoad

MEAN_PROMPT_TOKENS = 136  # the engine benchmark's prompts: uniform 16-256
MEAN_OUTPUT_TOKENS = 64  # its outputs: mean 64, capped at 256; a request's decode work is in units of this mean


@dataclass(frozen=True)
class EngineModel:
    capacity_rps: float = 1.2  # requests/s at a full batch, prefill included (engine bench: 64 in 52.8 s)
    max_num_seqs: int = 64
    prefill_tokens_per_s: float = 480.0  # engine bench: 8,332 prompt tokens in ~17 s of prefill steps
    half_rate_batch: float = 25.0  # decode gives half its asymptote at this batch (0.074 s + 2.9 ms/seq steps)
    kv_per_request: float = 0.011  # ~11 of the 1,024 blocks at the mean context of the shape
    cold_start_s: int = 30  # image pull and model load
    # the most prompt tokens of one request a step computes (vLLM's --long-prefill-token-threshold); 0: a whole
    # prompt in one go. A prompt of higher priority starts at the next chunk of one already prefilling.
    prefill_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if not (self.capacity_rps > 0 and self.max_num_seqs >= 1 and self.prefill_tokens_per_s > 0
                and self.half_rate_batch >= 0 and self.cold_start_s >= 0 and 0 < self.kv_per_request <= 1
                and self.prefill_chunk_tokens >= 0):
            raise ValueError("capacity_rps, max_num_seqs and prefill_tokens_per_s must be positive, half_rate_batch, "
                             "cold_start_s and prefill_chunk_tokens >= 0, kv_per_request in (0, 1]")
        if self.capacity_rps * self.mean_prefill_s >= 1:
            raise ValueError(f"{self.capacity_rps} requests/s would leave no time to decode after "
                             f"{self.mean_prefill_s:.2f} s prefills; lower capacity_rps")

    @property
    def mean_prefill_s(self) -> float:
        return MEAN_PROMPT_TOKENS / self.prefill_tokens_per_s

    @cached_property
    def decode_rps(self) -> list[float]:
        """Mean-sized requests finished per second of decoding, by the number running."""
        full = self.capacity_rps / (1 - self.capacity_rps * self.mean_prefill_s)  # decode-only rate at a full batch
        h, m = self.half_rate_batch, self.max_num_seqs
        return [full * n * (m + h) / (m * (n + h)) for n in range(m + 1)]

    @property
    def decode_tokens_per_s_full_batch(self) -> float:
        return self.decode_rps[self.max_num_seqs] * MEAN_OUTPUT_TOKENS

    def busy_s(self, prompt_tokens: int, work: float) -> float:
        """Seconds of a pod's time one request takes at a full batch: its prefill and its share of decoding."""
        return prompt_tokens / self.prefill_tokens_per_s + work / self.decode_rps[self.max_num_seqs]




@dataclass(slots=True)
class Request:
    rid: int
    arrival: float
    prefill_s: float
    work: float  # decode work in mean-sized requests
    priority: Priority = Priority.STANDARD
    first_token: float | None = None
    done: bool = False
    shed: bool = False  # refused by the gateway (429): never served
    prompt_tokens: int = 0  # as the trace said: what the gateway counts of the request and its answer
    output_tokens: int = 0
    resumed: bool = False  # preempted after its first token: its recomputation does not move that token
    batch: bool = False  # a Batch API request: below every interactive class at the engine

    @property
    def order(self) -> int:
        """Its engine priority (lower runs first)."""
        return BATCH_ENGINE_PRIORITY if self.batch else engine_priority(self.priority)


class Pod:
    """One engine: processor-shared decode over its batch; prompts prefill one at a time and decoding pauses while
    they do. A request whose prefill has not started counts as waiting in the metrics, as in vLLM's scheduler."""

    def __init__(self, engine: EngineModel, ready_at: float) -> None:
        self.engine, self.ready_at, self.draining = engine, ready_at, False
        self.asleep = False  # in the warm pool: loaded, its KV cache released, serving nothing until woken
        self.running: list[tuple[float, int, Request]] = []  # heap by the decode progress at which each ends
        self.waiting: list[tuple[int, int, Request]] = []  # beyond max_num_seqs: heap by (engine priority, order)
        # (start, seconds, request) by start, a prompt in one piece or, split by a higher-priority prompt, several;
        # trimmed by metrics()
        self.prefills: deque[tuple[float, float, Request]] = deque()
        self.progress = 0.0  # decode work every running request has received since the pod started
        self.prefill_free_at = 0.0
        self._queued = 0  # requests ever put in waiting: first come, first served within a priority

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def metrics(self, now: float) -> PodLoad:
        """What its /metrics would say now: KV usage, running, waiting."""
        while self.prefills and self.prefills[0][0] + self.prefills[0][1] <= now:
            self.prefills.popleft()  # done
        begun = {id(r) for start, _, r in self.prefills if start <= now}
        # not begun: waiting, as vLLM counts it (a split prompt whose first piece is done counts so again)
        pending = len({id(r) for start, _, r in self.prefills if start > now} - begun)
        running = len(self.running) - pending
        e = self.engine
        return PodLoad(running * e.kv_per_request, running, len(self.waiting) + pending, e.max_num_seqs,
                       e.prefill_tokens_per_s, e.decode_tokens_per_s_full_batch)

    def advance(self, start: float, end: float, arrivals: list[tuple[float, Request]]) -> None:
        """Serve from start to end, taking the arrivals (time-ordered) as they come."""
        if not self.running and not arrivals:
            return
        now, i = start, 0
        while True:
            n = len(self.running)
            next_arrival = arrivals[i][0] if i < len(arrivals) else end
            finish, per_request = math.inf, 0.0
            if n:
                per_request = self.engine.decode_rps[n] / n
                decoding_from = max(now, self.prefill_free_at)
                finish = decoding_from + max(0.0, self.running[0][0] - self.progress) / per_request
            at = min(next_arrival, finish)
            if n:
                self.progress += per_request * max(0.0, at - max(now, self.prefill_free_at))
            now = at
            if finish <= next_arrival:
                heapq.heappop(self.running)[2].done = True
                if self.waiting:
                    self._admit(heapq.heappop(self.waiting)[2], now)
            elif i < len(arrivals):
                request = arrivals[i][1]
                i += 1
                if n < self.engine.max_num_seqs:
                    self._admit(request, now)
                elif self._preempt_for(request, now):
                    self._admit(request, now)
                else:
                    self._queued += 1
                    heapq.heappush(self.waiting, (request.order, self._queued, request))
            else:
                return

    def _preempt_for(self, request: Request, now: float) -> bool:
        """Make room for a request that outranks a running one: the lowest-priority, latest-arrived running request
        goes back to waiting, its decoding lost (recomputed when it runs again)."""
        k = max(range(len(self.running)), key=lambda i: (self.running[i][2].order, self.running[i][2].arrival))
        victim = self.running[k][2]
        if victim.order <= request.order:
            return False
        self.running[k] = self.running[-1]
        self.running.pop()
        heapq.heapify(self.running)
        self.prefills = deque(piece for piece in self.prefills if piece[2] is not victim)
        if victim.first_token is not None and victim.first_token > now:  # its prefill had not finished
            victim.first_token = None
        victim.resumed = victim.first_token is not None
        self._queued += 1
        heapq.heappush(self.waiting, (victim.order, self._queued, victim))
        return True

    def _admit(self, request: Request, now: float) -> None:
        heapq.heappush(self.running, (self.progress + request.work, request.rid, request))
        at = len(self.prefills)
        while at and self.prefills[at - 1][0] > now and self.prefills[at - 1][2].order > request.order:
            at -= 1  # ahead of the prompts of lower priority that have not begun
        piece = (max(now, self.prefill_free_at) if at == len(self.prefills) else self.prefills[at][0],
                 request.prefill_s, request)
        self.prefills.insert(at, piece)
        if at and self.engine.prefill_chunk_tokens:
            at = self._split_before(at, now)
        start = self.prefills[at][0]  # the prompts from here on prefill back to back
        for k in range(at, len(self.prefills)):
            _, seconds, queued = self.prefills[k]
            self.prefills[k] = (start, seconds, queued)
            start += seconds
            if not queued.resumed:
                queued.first_token = start  # its last piece's end
        self.prefill_free_at = start

    def _split_before(self, at: int, now: float) -> int:
        """A lower-priority prompt prefilling now (just before `at`) stops at the end of its current chunk; its rest
        goes after the newly admitted prompt. The index the back-to-back schedule is recomputed from."""
        start, seconds, running = self.prefills[at - 1]
        arrived = self.prefills[at][2]
        if not (start <= now < start + seconds) or running.order <= arrived.order:
            return at
        chunk_s = self.engine.prefill_chunk_tokens / self.engine.prefill_tokens_per_s
        boundary = start + chunk_s * (math.floor((now - start) / chunk_s) + 1)
        if boundary >= start + seconds - 1e-9:
            return at
        self.prefills[at - 1] = (start, boundary - start, running)
        self.prefills[at] = (boundary, self.prefills[at][1], arrived)
        self.prefills.insert(at + 1, (0.0, start + seconds - boundary, running))
        return at
