"""`kvfleet bench capacity`: one engine's prefill and full-batch decode rates measured from outside, for a fleet
whose pods do not report their own (vLLM: spec.autoscaling.capacity). The window arithmetic on made-up arrival
times and an engine that is not there; the command against a real vLLM engine is in
tests/kvfleet/local/test_vllm_fleet.py (it shares that module's vLLM fleet)."""

from __future__ import annotations

import pytest

from kvfleet.capacity_probe import full_batch_rate, prefill_rate
from kvfleet.fleet.ports import free_port
from tests.support.commands import capacity_command


def test_the_decode_rate_counts_only_while_every_stream_was_decoding() -> None:
    # stream 1 runs alone from 0 to 1 s (10 tokens/s), then both decode from 1 to 3 s at 10 tokens/s each
    one = [i / 10 for i in range(31)]
    two = [1 + i / 10 for i in range(31)]
    assert full_batch_rate([one, two]) == pytest.approx(20.0, rel=0.05)


@pytest.mark.parametrize(("streams", "says"), [([[0.5], [0.7]], "more than one token"),
                                                ([[0.0, 1.0], [2.0, 3.0]], "never decoded together")])
def test_streams_that_say_nothing_about_a_full_batch_are_refused(streams, says) -> None:
    with pytest.raises(ValueError, match=says):
        full_batch_rate(streams)


def test_the_prefill_rate_is_the_extra_tokens_over_the_extra_time() -> None:
    assert prefill_rate((40, 0.10), (540, 0.60)) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="measure it idle"):
        prefill_rate((40, 0.50), (540, 0.40))


def test_an_engine_that_is_not_there_is_a_message_not_a_traceback() -> None:
    done = capacity_command("--url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--max-num-seqs", "4")
    assert done.returncode == 2 and "kvfleet bench capacity:" in done.stderr and "Traceback" not in done.stderr
