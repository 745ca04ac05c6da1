"""The questions and tolerances the engine is compared with transformers on."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea and the wind that blows over it at night.",
    "Explain in one sentence why the sky is blue, as if to a child who keeps asking why.",
    "List the planets of the solar system in order from the sun, then say which one is largest "
    "and which one has the most moons, and why Pluto is no longer counted among them.",
    "2+2=",
    "Translate 'good morning, how did you sleep?' into French, Spanish, German and Italian, "
    "and say for each language whether the greeting is formal or informal, with a short example of "
    "a reply that a friend might give in the same language.",
]


TOP_LOGPROBS, FIRST_TOKENS = 5, 3  # per answer, in the bfloat16 check

# a floor under the bfloat16 tolerance (logprob units): 30 layers of 8-bit mantissas move a logprob by 0.05-0.2 here
BF16_FLOOR = 0.25

SYSTEM = ("You are a careful assistant for a fleet of language model servers. Answer briefly and precisely, "
          "and never invent facts you are not sure about.")


def chat_prompts(tokenizer_dir: Path, count: int | None = None) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [
        list(tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for q in QUESTIONS[:count]
    ]
