"""Iteration-level scheduling (Orca, vLLM): every step re-forms one ragged batch.

One rule drives it, as in vLLM v1: each sequence's computed tokens catch up with its tokens
within a per-step token budget. Running sequences go first (decode tokens and the rest of
chunked prefills), then waiting ones are admitted by priority. When KV blocks run out the
lowest-priority, latest-arrived running sequence is preempted and later recomputed. A waiting request that
outranks a running one does not wait behind it (vLLM's priority policy): when the batch is full or its first
chunk's blocks are not free, the lowest-priority running sequence is preempted to make room.

Background requests (priority BATCH_ENGINE_PRIORITY or more: the Batch API's) sit out every step in which a
request of higher priority prefills or waits to be admitted: they keep their KV blocks and resume at the next step
without one, so an interactive prompt's steps are not lengthened by background decodes (on a CPU a step's time grows
with its batch). Between interactive prefills they decode as usual.

With LoRA adapters, the running batch holds at most max_loras distinct adapters (each needs a slot of weights).
A waiting request whose adapter would be one too many is passed by later requests, as in vLLM, but by at most one
batch's worth (max_num_seqs) of them: then nothing passes it, the running adapters drain, and it gets the slot.

Prompts that share a prefix arriving together (SGLang's in-batch prefix caching check): a waiting request whose next
uncached block another sequence computes in this step waits for the next step, where that block is a prefix-cache
hit, instead of computing its own copy beside it. The budget it would have spent goes to others. Each such wait
follows another sequence's progress on the request's own prefix, so it waits at most once per block of its prompt.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.sequence import Sequence, SequenceStatus


class QueueFullError(Exception):
    """The waiting queue is at max_num_waiting; the caller should retry later."""


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_num_waiting: int,
        static_batching: bool = False,
        max_loras: int | None = None,
        background_priority: int | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_waiting = max_num_waiting
        self.static_batching = static_batching
        self.max_loras = max_loras  # distinct adapters in the running batch (None: LoRA off)
        self.background_priority = background_priority  # at or above it, a request yields (None: none does)
        # the most prompt tokens of one sequence per step (vLLM's long_prefill_token_threshold; 0: the budget's)
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for _, seq in sorted(self._waiting, key=lambda item: item[0])]

    def prefill_tokens_pending(self) -> int:
        """Prompt tokens (and a preempted sequence's tokens) still to compute before each sequence's next token."""
        waiting = sum(seq.num_tokens - seq.num_computed_tokens for _, seq in self._waiting)
        # a decoding sequence has one token to compute (the one it just sampled): that is decode, not prefill
        left = (seq.num_tokens - seq.num_computed_tokens for seq in self.running)
        return waiting + sum(n for n in left if n > 1)

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self._waiting) >= self.max_num_waiting:
            raise QueueFullError(
                f"the engine's waiting queue is full ({self.max_num_waiting} requests); retry later"
            )
        self._push_waiting(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self._waiting = [item for item in self._waiting if item[1] is not seq]
            heapq.heapify(self._waiting)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=Sequence.sort_key)
        if self._may_admit():
            self._make_room_for_higher_priority(out)
        background = self._yielding()
        out_of_blocks = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.priority >= background:  # sorted by priority: every one from here on sits this step out
                break
            num_new = min(seq.num_new_tokens, budget, self.chunk_cap)
            while not self.block_manager.allocate(seq, num_new):
                out_of_blocks = True
                victim = self.running.pop()  # lowest priority, latest arrival
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                index += 1
        if not out_of_blocks and self._may_admit():
            self._admit_waiting(out, budget, background)
        return out

    def _yielding(self) -> float:
        """The priority from which sequences sit this step out: the background's while a request of higher priority
        waits or prefills; else none (infinity)."""
        bg = self.background_priority
        if bg is None:
            return float("inf")
        if any(seq.priority < bg for _, seq in self._waiting):
            return bg
        if any(seq.priority < bg and seq.num_new_tokens > 1 for seq in self.running):
            return bg
        return float("inf")

    def _make_room_for_higher_priority(self, out: SchedulerOutput) -> None:
        """Preempt running sequences (lowest priority, latest arrival first) while the first waiting request
        outranks them and could not be admitted otherwise. Equal priorities never preempt each other."""
        while self._waiting and self.running:
            head, victim = self._waiting[0][1], self.running[-1]
            if head.priority >= victim.priority or self._could_admit(head):
                return
            self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)

    def _could_admit(self, seq: Sequence) -> bool:
        if len(self.running) >= self.max_num_seqs or self._over_lora_cap(seq, self.running_adapters()):
            return False
        cached, num_new = self._first_chunk(seq, self.max_num_batched_tokens)
        return self.block_manager.can_allocate(seq, num_new, cached)

    def _first_chunk(self, seq: Sequence, budget: int) -> tuple[list[int], int]:
        """A waiting sequence's cached prefix blocks, and the new tokens it would compute on admission."""
        cached = self.block_manager.find_cached_prefix(seq)
        return cached, min(seq.num_tokens - self.block_manager.cached_prefix_tokens(cached), budget, self.chunk_cap)

    def _may_admit(self) -> bool:
        """Static batching admits only while its batch is forming: until a member starts decoding."""
        return not self.static_batching or not any(seq.output_token_ids for seq in self.running)

    def running_adapters(self) -> set[int]:
        """The LoRA adapters (by registration id) of the running batch."""
        return {seq.lora.id for seq in self.running if seq.lora is not None}

    def _over_lora_cap(self, seq: Sequence, adapters: set[int]) -> bool:
        return (self.max_loras is not None and seq.lora is not None and seq.lora.id not in adapters
                and len(adapters) >= self.max_loras)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, background: float = float("inf")) -> None:
        adapters = self.running_adapters()
        held_back: list[tuple[tuple[int, int], Sequence]] = []  # over the adapter cap: back in line afterwards
        deferred: list[tuple[tuple[int, int], Sequence]] = []  # their next block is computed this step: next step
        filled = {h for seq, n in out.scheduled for h in self.block_manager.blocks_filled_by(seq, n)}
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._waiting[0][1]
            if seq.priority >= background:  # by priority: the rest are background too
                break
            if any(seq is victim for victim in out.preempted):  # made room for others this step: not back at once
                break
            if self._over_lora_cap(seq, adapters):
                if seq.passed_by >= self.max_num_seqs:  # a batch's worth passed it: nothing more does
                    break
                held_back.append(heapq.heappop(self._waiting))
                continue
            cached, num_new = self._first_chunk(seq, budget)
            if filled and self.block_manager.next_uncached_block(seq, cached) in filled:
                deferred.append(heapq.heappop(self._waiting))
                continue
            num_cached_tokens = self.block_manager.cached_prefix_tokens(cached)
            if not self.block_manager.allocate(seq, num_new, cached):
                break
            heapq.heappop(self._waiting)
            for _, passed in held_back:
                passed.passed_by += 1
            if seq.lora is not None:
                adapters.add(seq.lora.id)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached_tokens
                self.block_manager.record_prefix_lookup(seq.num_prompt_tokens, num_cached_tokens)
            seq.num_computed_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            filled.update(self.block_manager.blocks_filled_by(seq, num_new))
        for item in held_back + deferred:
            heapq.heappush(self._waiting, item)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV now, keep its tokens, put it back in line by priority."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.sort_key(), seq))
