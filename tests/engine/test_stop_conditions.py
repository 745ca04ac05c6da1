"""Stop strings, stop token ids, EOS and max_tokens end a request with the right finish reason and text."""

from __future__ import annotations

from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.output_processor import RequestState, find_stop_string
from kvfleet.engine.sampling_params import SamplingParams

PROMPT = [300, 301, 302, 303]


def final_output(engine: LLMEngine, params: SamplingParams):
    return engine.generate([PROMPT], params)[0]


def test_max_tokens_ends_with_length(tiny_engine: LLMEngine) -> None:
    out = final_output(tiny_engine, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert (out.finish_reason, out.num_output_tokens) == ("length", 7)


def test_stop_string_cuts_the_text_before_it(tiny_engine: LLMEngine) -> None:
    full = final_output(tiny_engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    out = final_output(tiny_engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert out.num_output_tokens < 30


def test_streamed_deltas_never_show_part_of_a_stop_string(tiny_engine: LLMEngine) -> None:
    full = final_output(tiny_engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop = full.text[-6:]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    tiny_engine.add_request("s", PROMPT, params)
    streamed = ""
    while tiny_engine.has_unfinished_requests():
        for out in tiny_engine.step():
            streamed += out.text_delta
            assert stop not in streamed
    assert streamed == full.text[: full.text.index(stop)]


def test_stop_token_id_ends_with_stop(tiny_engine: LLMEngine) -> None:
    full = final_output(tiny_engine, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    tiny_engine.add_request("t", PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    tokens = []
    while tiny_engine.has_unfinished_requests():
        for out in tiny_engine.step():
            tokens += out.new_token_ids
    stop_id = tokens[4]
    out = final_output(tiny_engine, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.num_output_tokens == tokens.index(stop_id) + 1
    assert full.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_engine: LLMEngine) -> None:
    eos = min(tiny_engine.tokenizer.eos_token_ids)
    states = {}
    for ignore in (False, True):
        seq = tiny_engine.make_sequence(PROMPT, SamplingParams(max_tokens=5, ignore_eos=ignore))
        state = RequestState(seq, tiny_engine.tokenizer, tiny_engine.max_model_len)
        state.append_token(eos, None)
        states[ignore] = state
    assert states[False].finished and states[False].make_output().finish_reason == "stop"
    assert not states[True].finished


def test_find_stop_string_picks_the_earliest_overlapping_the_new_text() -> None:
    assert find_stop_string("hello world", 5, ["wor", "o w"]) == (4, "o w")
    assert find_stop_string("hello world", 2, ["hello"]) is None  # already fully in old text: not new
    assert find_stop_string("abcSTOP", 2, ["STOP"]) == (3, "STOP")
