"""The scheduler, driven the way LLMEngine.step drives it, finishes every request and never hands out wrong KV.

EngineSim plays the engine with a fake model: it "writes" each computed token into the block that holds its
position, so a test can see which tokens every block really holds. After every step it checks block accounting,
the prefix cache, the plan's budgets, who was preempted, and that each running sequence reads only its own tokens.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from kvfleet.engine.sequence import Sequence, SequenceStatus
from tests.support.kv_sim import write_kv


def random_tokens(seed: int, length: int) -> list[int]:
    """Prompt text from a seed, over a 4-token vocabulary so unrelated prompts share blocks now and then."""
    rng = random.Random(seed)
    return [rng.randrange(4) for _ in range(length)]


def sampled_token(seq: Sequence) -> int:
    """The fake model is greedy: the same tokens so far give the same next token."""
    return hash(tuple(seq.all_token_ids[-3:])) % 4


class EngineSim:
    """Steps a Scheduler as LLMEngine does and checks every invariant after each step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        self.contents: dict[int, list[int | None]] = {i: [None] * self.bm.block_size for i in range(self.bm.num_blocks)}
        self.prefix_of_hash: dict[bytes, tuple[int, ...]] = {}  # block hash -> every token up to the end of its block
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.aborted: list[Sequence] = []
        self.rejected: list[Sequence] = []
        self.total_tokens = 0  # prompt + max_tokens over accepted requests
        self.busy_steps = 0
        self.preempted: list[Sequence] = []

    # --- what the engine does -----------------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> bool:
        was_full = self.scheduler.num_waiting >= self.scheduler.max_num_waiting
        try:
            self.scheduler.add(seq)
        except QueueFullError:
            assert was_full, "rejected a request while the waiting queue had room"
            self.rejected.append(seq)
            return False
        assert not was_full, "accepted a request past max_num_waiting"
        self.live.append(seq)
        self.total_tokens += seq.num_prompt_tokens + seq.sampling_params.max_tokens
        self.check_state()
        return True

    def abort(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        assert seq.block_table == [] and seq.is_finished
        self.live = [s for s in self.live if s is not seq]
        self.aborted.append(seq)
        self.check_state()

    def step(self) -> SchedulerOutput:
        had_work = self.scheduler.has_work()
        running_before = list(self.scheduler.running)
        plan = self.scheduler.schedule()
        if had_work:
            self.busy_steps += 1
            assert not plan.is_empty, "the scheduler stalled with work to do"
        self.check_plan(plan, running_before)
        for seq, n in plan.scheduled:
            self.write_kv(seq, n)
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            self.record_hashes(seq)
        for seq, _ in plan.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(sampled_token(seq))
                if len(seq.output_token_ids) == seq.sampling_params.max_tokens:
                    self.scheduler.remove(seq)
                    self.live = [s for s in self.live if s is not seq]
                    self.finished.append(seq)
        self.preempted += plan.preempted
        self.check_state()
        return plan

    def drain(self) -> None:
        """Step until idle; fail if that takes longer than a generous bound (a stall or a preemption livelock)."""
        bound = 4 * self.total_tokens + 100
        while self.scheduler.has_work():
            assert self.busy_steps < bound, f"not done after {self.busy_steps} steps for {self.total_tokens} tokens"
            self.step()
        assert not self.live
        for seq in self.finished:
            assert len(seq.output_token_ids) == seq.sampling_params.max_tokens
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked after every request ended"

    def write_kv(self, seq: Sequence, n: int) -> None:
        write_kv(self.bm, self.contents, seq, n)

    def record_hashes(self, seq: Sequence) -> None:
        tokens = seq.all_token_ids
        for index, block_id in enumerate(seq.block_table):
            block_hash = self.bm.blocks[block_id].block_hash
            if block_hash is not None:
                prefix = tuple(tokens[:(index + 1) * self.bm.block_size])
                named = self.prefix_of_hash.setdefault(block_hash, prefix)
                assert named == prefix, f"block hash {block_hash} names two different token prefixes"

    # --- checks -------------------------------------------------------------------------------------------------

    def check_plan(self, plan: SchedulerOutput, running_before: list[Sequence]) -> None:
        sched = self.scheduler
        seqs = [seq for seq, _ in plan.scheduled]
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence was scheduled twice in one step"
        assert plan.num_tokens <= sched.max_num_batched_tokens
        assert len(seqs) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
        running = {id(s) for s in sched.running}
        for seq, n in plan.scheduled:
            assert 1 <= n <= seq.num_new_tokens, f"{seq.request_id} scheduled for {n} of {seq.num_new_tokens} tokens"
            assert n <= sched.chunk_cap, f"{seq.request_id}: {n} tokens in one step, over the long-prefill cap"
            assert id(seq) in running and seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens + n)
            self.check_own_kv(seq)  # a newly admitted sequence's prefix-cache hits hold its own tokens
        # Background work never shares a step with a higher-priority prefill.
        bg = sched.background_priority
        if bg is not None and any(s.priority < bg and n > 1 for s, n in plan.scheduled):
            assert all(s.priority < bg for s in seqs), "a background sequence ran beside a foreground prefill"
        # Victims go lowest priority, latest arrival first, from the running set as it stood.
        lowest_first = sorted(running_before, key=Sequence.sort_key, reverse=True)
        assert [s.request_id for s in plan.preempted] == [s.request_id for s in lowest_first[:len(plan.preempted)]]
        for victim in plan.preempted:
            assert victim.status is SequenceStatus.WAITING and victim.block_table == []
            assert victim.num_computed_tokens == 0 and id(victim) not in {id(s) for s in seqs}

    def check_state(self) -> None:
        sched, bm = self.scheduler, self.bm
        waiting = sched.waiting
        assert sorted(id(s) for s in sched.running + waiting) == sorted(id(s) for s in self.live)
        for seq in waiting:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == [], f"waiting {seq.request_id} holds KV"
        owners = Counter(block_id for seq in sched.running for block_id in seq.block_table)
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq.request_id} holds a block twice"
            assert bm.blocks_needed(seq.num_computed_tokens) <= len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)
            self.check_own_kv(seq)
        for block in bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == owners[block.block_id], f"block {block.block_id}: ref count vs owners"
        assert set(bm.free_queue) == {b.block_id for b in bm.blocks if b.ref_count == 0}
        assert bm.num_free_blocks + len(owners) == bm.num_blocks
        for block_hash, block_id in bm.cached_blocks.items():
            assert bm.blocks[block_id].block_hash == block_hash
            assert self.contents[block_id] == list(self.prefix_of_hash[block_hash][-bm.block_size:])
        for block in bm.blocks:
            if block.block_hash is not None:
                assert bm.cached_blocks.get(block.block_hash) == block.block_id, "stale block hash"

    def check_own_kv(self, seq: Sequence) -> None:
        size = self.bm.block_size
        tokens = seq.all_token_ids
        for pos in range(seq.num_computed_tokens):
            assert self.contents[seq.block_table[pos // size]][pos % size] == tokens[pos], (
                f"{seq.request_id} position {pos} reads another sequence's KV"
            )


@st.composite
def engine_configs(draw: st.DrawFn, tight: bool = False) -> dict:
    """Tiny engines; tight ones fit exactly one longest request and run several at once, so they must preempt."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]), label="block size")
    fewest = -(-2 // block_size)  # a one-token prompt and one output token must fit
    num_blocks = draw(st.integers(fewest, max(3, min(12, 48 // block_size))), label="num blocks")
    capacity = num_blocks * block_size
    max_model_len = capacity if tight else draw(st.just(capacity) | st.integers(2, capacity), label="max model len")
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_model_len": max_model_len,
        "prefix_caching": draw(st.just(True) | st.booleans(), label="prefix caching"),
        "max_num_batched_tokens": draw(st.integers(1, 12) | st.just(max_model_len), label="token budget"),
        "max_num_seqs": draw(st.integers(2 if tight else 1, 4), label="max num seqs"),
        "max_num_waiting": draw(st.integers(1, 6), label="max num waiting"),
        # priority 2 (of 0-2) as background: it sits out steps in which a higher priority prefills or waits
        "background_priority": draw(st.none() | st.just(2), label="background priority"),
        "long_prefill": draw(st.just(0) | st.integers(1, 8), label="long prefill token threshold"),
    }


@st.composite
def requests(draw: st.DrawFn, config: dict, system_prompts: list[list[int]], request_id: str) -> Sequence:
    """A request the engine would accept: prompt + max_tokens <= max_model_len, often block-aligned or shared."""
    max_len, size = config["max_model_len"], config["block_size"]
    boundaries = list(range(size, max_len, size))
    lengths = st.integers(1, max_len - 1) | (st.sampled_from(boundaries) if boundaries else st.nothing())
    length = draw(lengths, label="prompt length")
    system = draw(st.sampled_from(system_prompts), label="system prompt")
    shared = draw(st.just(length) | st.integers(0, length), label="shared length")
    tail = random_tokens(draw(st.integers(0, 2**16), label="tail seed"), length - shared)
    max_tokens = draw(st.just(max_len - length) | st.integers(1, max_len - length), label="max tokens")
    priority = draw(st.integers(0, 2), label="priority")
    return Sequence(request_id, system[:shared] + tail, SamplingParams(max_tokens=max_tokens), priority=priority)


def build_engine(config: dict) -> EngineSim:
    bm = BlockManager(config["num_blocks"], config["block_size"], config["prefix_caching"])
    return EngineSim(Scheduler(bm, config["max_num_seqs"], config["max_num_batched_tokens"], config["max_num_waiting"],
                               background_priority=config["background_priority"],
                               long_prefill_token_threshold=config["long_prefill"]))


def report_coverage(sim: EngineSim) -> None:
    """Shown by --hypothesis-show-statistics: how often the hard cases came up."""
    event(f"preempted: {bool(sim.preempted)}")
    event(f"prefix hits: {sim.bm.prefix_hits > 0}")
    event(f"queue full: {bool(sim.rejected)}")
    event(f"aborted: {bool(sim.aborted)}")


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps; at the end every request must finish within a bounded number of steps."""

    @initialize(config=engine_configs(), prefix_seeds=st.lists(st.integers(0, 2**16), min_size=1, max_size=2))
    def setup(self, config: dict, prefix_seeds: list[int]) -> None:
        self.config = config
        self.sim = build_engine(config)
        self.system_prompts = [random_tokens(seed, config["max_model_len"]) for seed in prefix_seeds]
        self.next_id = 0

    @rule(data=st.data(), count=st.integers(1, 3))
    def submit(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            self.sim.submit(data.draw(requests(self.config, self.system_prompts, f"r{self.next_id}")))
            self.next_id += 1

    @precondition(lambda self: self.sim.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.sim.abort(data.draw(st.sampled_from(self.sim.live), label="aborted"))

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.sim.step()

    def teardown(self) -> None:
        if hasattr(self, "sim"):
            self.sim.drain()
            report_coverage(self.sim)


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


@st.composite
def workloads(draw: st.DrawFn, tight: bool = False) -> tuple[dict, list[tuple[int, Sequence, int | None]]]:
    """An engine config and requests as (arrival step, request, abort step or None), mostly never aborted."""
    config = draw(engine_configs(tight))
    seeds = draw(st.lists(st.integers(0, 2**16), min_size=1, max_size=2), label="system prompt seeds")
    system_prompts = [random_tokens(seed, config["max_model_len"]) for seed in seeds]
    # Bursts, then stragglers; drawn in arrival order so arrival_order matches when the engine would see them.
    arrivals = sorted(draw(st.lists(st.just(0) | st.integers(0, 12), min_size=2, max_size=8), label="arrival steps"))
    program = []
    for index, arrival in enumerate(arrivals):
        seq = draw(requests(config, system_prompts, f"r{index}"))
        aborts = st.none() if tight else st.none() | st.none() | st.integers(arrival, arrival + 12)
        abort_at = draw(aborts, label="abort step")
        program.append((arrival, seq, abort_at))
    return config, program


Workload = tuple[dict, list[tuple[int, Sequence, int | None]]]


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_every_request_finishes_under_load(workload: Workload) -> None:
    run_workload(workload)


@settings(max_examples=200, deadline=None)
@given(workloads(tight=True))
def test_every_request_finishes_when_the_pool_fits_one_longest_request(workload: Workload) -> None:
    run_workload(workload)


def run_workload(workload: Workload) -> None:
    config, program = workload
    sim = build_engine(config)
    last_event = max(max(arrival, abort_at or 0) for arrival, _, abort_at in program)
    for now in range(last_event + 1):
        for arrival, seq, abort_at in program:
            if arrival == now:
                sim.submit(seq)
            if abort_at == now and any(s is seq for s in sim.live):
                sim.abort(seq)
        sim.step()
    sim.drain()
    accepted = sim.finished + sim.aborted
    assert sorted(s.request_id for s in accepted + sim.rejected) == sorted(s.request_id for _, s, _ in program)
    report_coverage(sim)


# --- examples that read as documentation ----------------------------------------------------------------------------


def make_engine(num_blocks: int, block_size: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                max_num_waiting: int = 16, background_priority: int | None = None) -> EngineSim:
    bm = BlockManager(num_blocks, block_size)
    return EngineSim(Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_num_waiting,
                               background_priority=background_priority))


def request(request_id: str, prompt: list[int], max_tokens: int, priority: int = 0) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)


@pytest.mark.parametrize(("system_len", "shared_tokens"), [(8, 8), (10, 8), (7, 4)])
def test_shared_system_prompt_is_computed_once(system_len: int, shared_tokens: int) -> None:
    engine = make_engine(num_blocks=16, block_size=4)
    system = list(range(100, 100 + system_len))
    first = request("first", system + [1, 2, 3], max_tokens=4)
    engine.submit(first)
    engine.step()
    assert engine.bm.prefix_hits == 0

    second = request("second", system + [7, 8], max_tokens=4)
    engine.submit(second)
    plan = engine.scheduler.schedule()
    assert second.num_computed_tokens == shared_tokens == second.num_cached_tokens
    assert {s.request_id: n for s, n in plan.scheduled}["second"] == second.num_tokens - shared_tokens
    assert second.block_table[:shared_tokens // 4] == first.block_table[:shared_tokens // 4]
    assert engine.bm.prefix_hits == shared_tokens


def test_prompts_sharing_a_prefix_that_arrive_together_compute_it_once() -> None:
    # vLLM's prefix_repetition shape in small: both arrive before the first step, the shared blocks are cached by
    # neither. The second waits one step rather than compute its own copy, then hits all of them.
    engine = make_engine(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    system = list(range(100, 112))  # three blocks
    first, second = request("first", system + [1, 2, 3], max_tokens=3), request("second", system + [7, 8], max_tokens=3)
    third = request("third", [5] * 9, max_tokens=3)  # shares nothing: not held back
    for seq in (first, second, third):
        engine.submit(seq)
    plan = engine.step()
    assert [s.request_id for s, _ in plan.scheduled] == ["first", "third"]
    plan = engine.step()
    assert {s.request_id: n for s, n in plan.scheduled}["second"] == 2
    assert second.num_cached_tokens == 12 and second.block_table[:3] == first.block_table[:3]
    engine.drain()
    assert engine.bm.prefix_hits == 12
    for seq in (first, second, third):
        assert seq.output_token_ids == run_alone(seq, 32, 4)


def test_a_prompt_waits_for_a_shared_prefix_only_while_another_computes_it() -> None:
    # a 40-token prompt in 8-token chunks: the request behind it that shares its first 12 tokens waits only while
    # those blocks are being computed, then starts from them in the step after.
    bm = BlockManager(64, 4)
    engine = EngineSim(Scheduler(bm, 8, 64, 16, long_prefill_token_threshold=8))
    shared = list(range(200, 212))
    long = request("long", shared + [1] * 28, max_tokens=2)
    short = request("short", shared + [2, 3], max_tokens=2)
    engine.submit(long)
    engine.submit(short)
    assert [s.request_id for s, _ in engine.step().scheduled] == ["long"]  # blocks 0-1
    assert [s.request_id for s, _ in engine.step().scheduled] == ["long"]  # blocks 2-3: block 2 is short's next
    plan = engine.step()
    assert {s.request_id for s, _ in plan.scheduled} == {"long", "short"} and short.num_cached_tokens == 12
    engine.drain()
    assert short.output_token_ids == run_alone(short, 64, 4)


def test_identical_block_aligned_prompt_recomputes_only_its_last_block() -> None:
    engine = make_engine(num_blocks=16, block_size=4)
    prompt = list(range(8))
    engine.submit(request("a", prompt, max_tokens=2))
    engine.drain()
    again = request("b", prompt, max_tokens=2)
    engine.submit(again)
    engine.step()
    assert again.num_cached_tokens == 4, "the last prompt token must run to produce logits"
    engine.drain()
    assert len(again.output_token_ids) == 2


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_preempted_request_is_recomputed_and_finishes(block_size: int) -> None:
    # Room for one longest request plus one block: two of them must take turns.
    engine = make_engine(num_blocks=16 // block_size + 1, block_size=block_size, max_num_batched_tokens=4)
    early = request("early", [1] * 8, max_tokens=8)
    late = request("late", [2] * 8, max_tokens=8)
    engine.submit(early)
    engine.submit(late)
    engine.drain()
    assert engine.scheduler.num_preemptions >= 1
    assert late.num_preemptions >= 1 and early.num_preemptions == 0, "the later arrival is preempted"
    assert [s.request_id for s in engine.finished] == ["early", "late"]
    alone = make_engine(num_blocks=16 // block_size + 1, block_size=block_size)
    alone.submit(late_alone := request("late", [2] * 8, max_tokens=8))
    alone.drain()
    assert late.output_token_ids == late_alone.output_token_ids, "recomputing must not change the output"


def test_higher_priority_request_keeps_its_blocks() -> None:
    engine = make_engine(num_blocks=9, block_size=2, max_num_batched_tokens=4)
    background = request("background", [1] * 8, max_tokens=8, priority=1)
    urgent = request("urgent", [2] * 8, max_tokens=8, priority=0)
    engine.submit(background)
    engine.step()
    engine.submit(urgent)
    engine.drain()
    assert urgent.num_preemptions == 0 and background.num_preemptions >= 1
    assert engine.finished[0] is urgent


def run_alone(seq: Sequence, num_blocks: int, block_size: int) -> list[int]:
    alone = make_engine(num_blocks=num_blocks, block_size=block_size)
    alone.submit(copy := request(seq.request_id, seq.prompt_token_ids, seq.sampling_params.max_tokens))
    alone.drain()
    return copy.output_token_ids


def test_a_critical_request_takes_a_slot_in_a_full_batch_from_the_latest_standard_one() -> None:
    engine = make_engine(num_blocks=32, block_size=4, max_num_seqs=2)
    first, second = request("first", [1] * 6, max_tokens=12), request("second", [2] * 6, max_tokens=12)
    engine.submit(first)
    engine.submit(second)
    for _ in range(3):
        engine.step()
    critical = request("critical", [3] * 6, max_tokens=4, priority=-1)
    engine.submit(critical)
    plan = engine.step()
    assert [s.request_id for s in plan.preempted] == ["second"]
    assert critical in engine.scheduler.running and first in engine.scheduler.running
    assert second not in [s for s, _ in plan.scheduled], "a victim is not readmitted in the step that preempted it"
    engine.drain()
    assert [s.request_id for s in engine.finished] == ["critical", "first", "second"]
    for seq in (first, second, critical):
        assert seq.output_token_ids == run_alone(seq, 32, 4), "recomputing must not change the output"


def test_a_critical_request_takes_blocks_from_lower_priority_work_when_kv_is_full() -> None:
    # 8 blocks of 2 tokens: two 6-token prompts growing to 8 tokens hold all of them; slots are free.
    engine = make_engine(num_blocks=8, block_size=2, max_num_seqs=8)
    low = [request(f"low{k}", [k + 1] * 6, max_tokens=3) for k in range(2)]
    for seq in low:
        engine.submit(seq)
    engine.step()
    critical = request("critical", [7] * 5, max_tokens=2, priority=-1)
    engine.submit(critical)
    engine.step()
    assert critical in engine.scheduler.running and critical.num_preemptions == 0
    assert low[1].num_preemptions == 1 and low[0].num_preemptions == 0
    engine.drain()
    assert engine.finished[0] is critical


def test_background_decodes_sit_out_an_interactive_prefill_and_resume_unchanged() -> None:
    engine = make_engine(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8,
                         background_priority=10)
    batch = [request(f"batch{k}", [k + 1] * 4, max_tokens=12, priority=10) for k in range(3)]
    for seq in batch:
        engine.submit(seq)
    engine.step()  # the batch prefills
    assert [s for s, _ in engine.step().scheduled] == batch  # alone, background work decodes every step
    interactive = request("chat", [9] * 20, max_tokens=3)  # a 20-token prompt: three steps of 8
    engine.submit(interactive)
    prefill_steps = 0
    while interactive.num_computed_tokens < interactive.num_prompt_tokens:
        plan = engine.step()
        assert [s.request_id for s, _ in plan.scheduled] == ["chat"], "only the prompt runs while it prefills"
        prefill_steps += 1
    assert prefill_steps == 3 and not engine.scheduler.num_preemptions  # they kept their KV
    assert {s.request_id for s, _ in engine.step().scheduled} == {"chat", "batch0", "batch1", "batch2"}
    engine.drain()
    for seq in batch:
        assert seq.output_token_ids == run_alone(seq, 64, 4)


def test_without_a_background_priority_every_running_sequence_decodes_beside_a_prefill() -> None:
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    for k in range(2):
        engine.submit(request(f"batch{k}", [k + 1] * 4, max_tokens=12, priority=10))
    engine.step()
    engine.submit(request("chat", [9] * 20, max_tokens=3))
    assert {s.request_id for s, _ in engine.step().scheduled} == {"batch0", "batch1", "chat"}


def test_a_long_prefill_is_chunked_so_a_critical_prompt_starts_after_one_chunk() -> None:
    bm = BlockManager(64, 4)
    engine = EngineSim(Scheduler(bm, 8, 64, 16, long_prefill_token_threshold=8))
    long = request("long", [1] * 40, max_tokens=2)
    engine.submit(long)
    assert engine.step().scheduled == [(long, 8)]  # 8 of its 40 prompt tokens
    critical = request("critical", [2] * 6, max_tokens=2, priority=-1)
    engine.submit(critical)
    plan = engine.step()
    assert (critical, 6) in plan.scheduled and (long, 8) in plan.scheduled  # both go on; neither waits the other
    engine.drain()
    assert long.output_token_ids == run_alone(long, 64, 4)


def test_equal_priorities_never_preempt_each_other_for_a_slot() -> None:
    engine = make_engine(num_blocks=32, block_size=4, max_num_seqs=2)
    for name in ("a", "b"):
        engine.submit(request(name, [1] * 6, max_tokens=8))
    engine.step()
    engine.submit(late := request("late", [2] * 6, max_tokens=2))
    engine.drain()
    assert engine.scheduler.num_preemptions == 0 and engine.finished[-1] is late


def test_full_waiting_queue_rejects_then_accepts_after_admission() -> None:
    engine = make_engine(num_blocks=8, block_size=4, max_num_waiting=1)
    engine.submit(request("a", [1, 2, 3], max_tokens=2))
    with pytest.raises(QueueFullError, match="retry later"):
        engine.scheduler.add(request("b", [4, 5, 6], max_tokens=2))
    engine.step()
    assert engine.submit(request("c", [4, 5, 6], max_tokens=2))
    engine.drain()
    assert [s.request_id for s in engine.finished] == ["a", "c"]
