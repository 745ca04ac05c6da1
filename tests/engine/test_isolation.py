"""A request that fails inside a step (sampler, detokenizer, stop handling) fails alone: it gets an error, and every
other request in its batch produces exactly the tokens it produces in a run without the failure.

The faults are injected into one sequence of a real running batch (real tiny model, real sampler and tokenizer):
no valid input makes those parts raise, so the test wraps them for one request id.
"""

from __future__ import annotations

from pathlib import Path

from kvfleet.engine.llm_engine import OUTPUT_ERROR, SAMPLER_ERROR, LLMEngine
from kvfleet.engine.sampler import Sampler
from kvfleet.engine.sampling_params import SamplingParams
from tests.conftest import make_engine

VICTIMS = {  # greedy, seeded random (at the top of the 64-bit seed range), penalties with logit_bias
    "greedy": ([11] * 10, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
    "seeded": ([13] * 14, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=2**64 - 1, ignore_eos=True)),
    "penalized": ([14] * 7, SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3,
                                           logit_bias={15: 5.0}, ignore_eos=True)),
}
BAD = ([12] * 12, SamplingParams(max_tokens=8, temperature=0.7, seed=7, ignore_eos=True))


def run(engine: LLMEngine, with_bad: bool) -> tuple[dict, dict[str, list[int]]]:
    """Final outputs and every request's generated token ids."""
    for name, (prompt, params) in VICTIMS.items():
        engine.add_request(name, prompt, params)
    if with_bad:
        engine.add_request("bad", *BAD)
    final, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    return final, tokens


def assert_victims_unharmed(engine: LLMEngine, final: dict, tokens: dict, expected: tuple[dict, dict]) -> None:
    expected_final, expected_tokens = expected
    for name in VICTIMS:
        assert final[name].finish_reason == "length", name
        assert tokens[name] == expected_tokens[name], name
        assert final[name].text == expected_final[name].text, name
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


class FailsForBad(Sampler):
    """The real sampler, raising whenever the batch holds request `bad` after its third token; it raises after
    sampling, so the random streams have moved on, as they would in a failure deep inside the sampler."""

    def __call__(self, logits, rows):
        result = super().__call__(logits, rows)
        if any(row.request_id == "bad" and len(row.output_token_ids) >= 3 for row in rows):
            raise RuntimeError("injected sampler failure")
        return result


def test_a_sampler_failure_in_one_row_fails_only_that_request(tiny_model_dir: Path) -> None:
    expected = run(make_engine(tiny_model_dir), with_bad=False)
    engine = make_engine(tiny_model_dir)
    engine.sampler = FailsForBad(engine.config.seed)  # same seed, nothing drawn yet: the same random stream
    final, tokens = run(engine, with_bad=True)
    assert final["bad"].finish_reason == "error" and final["bad"].error == SAMPLER_ERROR
    assert final["bad"].num_output_tokens == 3
    assert_victims_unharmed(engine, final, tokens, expected)


def test_a_detokenizer_failure_fails_only_that_request(tiny_model_dir: Path) -> None:
    expected = run(make_engine(tiny_model_dir), with_bad=False)
    engine = make_engine(tiny_model_dir)
    real_state = engine.add_sequence

    def add_sequence(seq):  # the request's own detokenizer raises on its fourth token
        real_state(seq)
        if seq.request_id == "bad":
            detokenizer = engine.requests["bad"].detokenizer
            push, calls = detokenizer.push, []

            def failing_push(ids: list[int]) -> str:
                calls.append(ids)
                if len(calls) == 4:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
                return push(ids)

            detokenizer.push = failing_push

    engine.add_sequence = add_sequence
    final, tokens = run(engine, with_bad=True)
    assert final["bad"].finish_reason == "error" and final["bad"].error == OUTPUT_ERROR
    assert_victims_unharmed(engine, final, tokens, expected)


def test_parameters_that_make_probabilities_non_finite_fail_only_that_request(tiny_model_dir: Path) -> None:
    expected = run(make_engine(tiny_model_dir), with_bad=False)
    engine = make_engine(tiny_model_dir)
    engine.add_request("tiny-penalty", [12] * 12, SamplingParams(max_tokens=8, temperature=1.0,
                                                                  repetition_penalty=1e-300, ignore_eos=True))
    final, tokens = run(engine, with_bad=False)
    assert final["tiny-penalty"].finish_reason == "error"
    assert "non-finite" in final["tiny-penalty"].error
    assert_victims_unharmed(engine, final, tokens, expected)
