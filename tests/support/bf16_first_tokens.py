"""Run in a process of its own by tests/engine/test_hf_parity.py: SmolLM2 in bfloat16 on the CPU answers the parity
prompts' first tokens with their top logprobs, written as JSON to the file named, so that the parent can choose the
process's oneDNN instruction set (ONEDNN_MAX_CPU_ISA, read once when oneDNN starts) and read which one ran
(ONEDNN_VERBOSE).

    python -m tests.support.bf16_first_tokens MODEL_DIR OUT_JSON [QUESTIONS]   # the first QUESTIONS (default: all)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.packed_linear import PackedLinear
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.hf_parity import FIRST_TOKENS, TOP_LOGPROBS, chat_prompts


def main(model_dir: Path, out: Path, count: int | None = None) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=16, max_model_len=256, max_num_seqs=8,
                                    dtype="bfloat16"), show_progress=False)
    params = SamplingParams(max_tokens=FIRST_TOKENS, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True)
    answers: dict[str, list[dict]] = {}
    for i, prompt in enumerate(chat_prompts(model_dir, count)):
        engine.add_request(str(i), prompt, params)
        answers[str(i)] = []
    while engine.has_unfinished_requests():
        for step in engine.step():
            answers[step.request_id] += [{"token": t, "top": lp.top}
                                         for t, lp in zip(step.new_token_ids, step.logprobs, strict=True)]
    out.write_text(json.dumps({
        "packed": any(isinstance(m, PackedLinear) for m in engine.model.modules()),
        "decode_in_place": engine.runner.backend.decode_in_place is not None,
        "answers": [answers[str(i)] for i in range(len(answers))]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
