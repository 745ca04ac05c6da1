"""A request that fails inside a step fails alone; the rest of its batch goes on.

The faults are injected (NaN logits for one request, an exception while computing one request):
no real input makes the model produce them, so the test wraps the real model runner.
"""

from __future__ import annotations

import math

from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run_all(engine: LLMEngine) -> dict[str, object]:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def submit_three(engine: LLMEngine) -> None:
    for name, prompt in (("a", [11] * 10), ("bad", [12] * 12), ("c", [13] * 14)):
        engine.add_request(name, prompt, PARAMS)


def test_nan_logits_fail_only_that_request(tiny_engine: LLMEngine) -> None:
    expected = tiny_engine.generate([[11] * 10, [13] * 14], PARAMS)
    execute = tiny_engine.runner.execute

    def poisoned(scheduled):
        seqs, logits = execute(scheduled)
        logits = logits.clone()  # the runner returns an inference-mode tensor
        for i, seq in enumerate(seqs):
            if seq.request_id == "bad" and seq.output_token_ids:
                logits[i] = math.nan
        return seqs, logits

    tiny_engine.runner.execute = poisoned
    submit_three(tiny_engine)
    final = run_all(tiny_engine)
    assert final["bad"].finish_reason == "error"
    assert "non-finite logits" in final["bad"].error
    assert final["bad"].num_output_tokens == 1
    assert [final["a"].finish_reason, final["c"].finish_reason] == ["length", "length"]
    assert final["a"].text == expected[0].text and final["c"].text == expected[1].text
    assert tiny_engine.stats().kv_blocks_free == tiny_engine.stats().kv_blocks_total


def test_exception_while_computing_one_request_fails_it_alone(tiny_engine: LLMEngine) -> None:
    expected = tiny_engine.generate([[11] * 10, [13] * 14], PARAMS)
    execute = tiny_engine.runner.execute

    def crashing(scheduled):
        if any(seq.request_id == "bad" and seq.num_computed_tokens > 12 for seq, _ in scheduled):
            raise RuntimeError("injected kernel failure")
        return execute(scheduled)

    tiny_engine.runner.execute = crashing
    submit_three(tiny_engine)
    final = run_all(tiny_engine)
    assert final["bad"].finish_reason == "error"
    assert final["bad"].error == "the engine failed while computing this request"
    assert final["a"].text == expected[0].text and final["c"].text == expected[1].text
    assert final["a"].num_output_tokens == final["c"].num_output_tokens == 6
    assert tiny_engine.stats().kv_blocks_free == tiny_engine.stats().kv_blocks_total
