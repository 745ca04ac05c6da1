"""The --max-loras cap in the scheduler: a batch never holds more distinct adapters than there are slots, every
request finishes whatever the mix, and a request for an adapter outside the batch is not starved by a stream of
requests for the adapters inside it (at most a batch's worth of them pass it)."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.lora_registry import LoraSpec
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.sequence import Sequence

ADAPTERS = [LoraSpec(f"adapter-{i}", Path(f"/adapters/{i}"), i + 1) for i in range(6)]


def request(name: str, adapter: LoraSpec | None, output: int = 3, priority: int = 0) -> Sequence:
    # a prompt of its own: requests that share a prefix block are spread over steps (the scheduler's in-batch prefix
    # check), which these tests of the adapter cap are not about
    return Sequence(name, [next(_first_tokens), 2, 3, 4, 5], SamplingParams(max_tokens=output), priority=priority,
                    lora=adapter)


_first_tokens = itertools.count(1000)


def step(scheduler: Scheduler) -> list[Sequence]:
    """One engine step with a fake model: computed tokens catch up; a sequence that caught up gets a token, and
    finishes at its max_tokens. Returns the sequences that finished."""
    plan = scheduler.schedule()
    done = []
    for seq, n in plan.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) == seq.sampling_params.max_tokens:
                scheduler.remove(seq)
                done.append(seq)
    return done


def scheduler(max_loras: int, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(BlockManager(256, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                     max_num_waiting=1000, max_loras=max_loras)


def test_a_stream_of_one_adapters_requests_lets_another_adapter_in() -> None:
    s = scheduler(max_loras=1)
    s.add(request("a-0", ADAPTERS[0]))
    step(s)
    s.add(request("b", ADAPTERS[1]))  # waits: adapter 0 holds the only slot
    finished, steps = [], 0
    while "b" not in {seq.request_id for seq in finished}:
        s.add(request(f"a-{steps + 1}", ADAPTERS[0]))  # a new request for the running adapter every step
        finished += step(s)
        assert len(s.running_adapters()) <= 1
        steps += 1
        assert steps < 40, "the request for the other adapter starved"
    passed = [seq for seq in finished if seq.request_id.startswith("a-") and seq.request_id != "a-0"]
    assert 0 < len(passed) <= s.max_num_seqs + 1  # some went ahead of it (vLLM skips), at most a batch's worth


def test_requests_of_the_base_model_run_beside_the_capped_adapters() -> None:
    s = scheduler(max_loras=1, max_num_seqs=8)
    for i in range(3):
        s.add(request(f"a-{i}", ADAPTERS[0]))
        s.add(request(f"b-{i}", ADAPTERS[1]))
        s.add(request(f"base-{i}", None))
    s.schedule()
    running = {seq.request_id for seq in s.running}
    assert running == {"a-0", "a-1", "a-2", "base-0", "base-1", "base-2"}


@settings(max_examples=60, deadline=None)
@given(adapters=st.lists(st.sampled_from([None, *ADAPTERS]), min_size=1, max_size=30),
       max_loras=st.integers(1, 4), max_num_seqs=st.integers(1, 6), outputs=st.integers(1, 4))
def test_every_request_finishes_and_no_batch_exceeds_the_cap(adapters: list, max_loras: int, max_num_seqs: int,
                                                            outputs: int) -> None:
    s = scheduler(max_loras, max_num_seqs)
    for i, adapter in enumerate(adapters):
        s.add(request(str(i), adapter, output=outputs))
    finished = 0
    for _ in range(len(adapters) * (outputs + 6) + 10):
        finished += len(step(s))
        assert len(s.running_adapters()) <= max_loras
        if not s.has_work():
            break
    assert finished == len(adapters)
