"""CUDA graphs of decode steps (issue 23, item 3): which batch sizes are captured, how a step's inputs are padded
into the graph's buffers (pure, checked on any machine), and, on a CUDA GPU only, that replayed decode steps give the
eager engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.cuda_graphs import decode_inputs, graph_batch_sizes, padded_batch_size
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence


def test_the_captured_sizes_climb_by_powers_then_eights_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(128)[-3:] == [112, 120, 128] and len(graph_batch_sizes(128)) == 19
    assert graph_batch_sizes(4096)[-1] == 512  # beyond it, decode steps run eagerly


def test_a_step_replays_the_smallest_graph_that_holds_it_or_none() -> None:
    sizes = graph_batch_sizes(24)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 8, 9, 24, 25)] == [1, 4, 8, 8, 16, 24, None]


def test_padding_rows_read_and_write_only_the_spare_block() -> None:
    seq = Sequence("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    seq.output_token_ids = [10]
    seq.num_computed_tokens = 5  # token 10 at position 5 is this step's input
    seq.block_table = [3, 7]  # block size 4: position 5 is block 7, offset 1
    inputs = decode_inputs([seq], size=4, block_size=4, width=3, pad_block=99)
    assert inputs.input_ids == [10, 0, 0, 0] and inputs.positions == [5, 0, 0, 0]
    assert inputs.slots == [7 * 4 + 1, 99 * 4, 99 * 4, 99 * 4]
    assert inputs.block_tables == [[3, 7, 99], [99] * 3, [99] * 3, [99] * 3]
    assert inputs.seq_lens == [6, 1, 1, 1]


def test_the_engine_takes_enforce_eager_as_vllm_does() -> None:
    from kvfleet.cli import build_parser
    from kvfleet.engine.cli_args import engine_config_from_args

    config = engine_config_from_args(build_parser().parse_args(["engine", "--enforce-eager"]))
    assert config.enforce_eager is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replayed_decode_steps_give_the_eager_engines_greedy_tokens(tiny_model_dir) -> None:
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    prompts = [[100 + i] * (8 + 3 * i) for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = []
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_seqs=8,
                                        dtype="float32", enforce_eager=eager), show_progress=False)
        assert (engine.runner.graphs is None) is eager
        results.append([out.text for out in engine.generate(prompts, params)])
    assert results[0] == results[1]
