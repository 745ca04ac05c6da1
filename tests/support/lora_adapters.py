"""Real PEFT adapters for tests and benchmarks: peft wraps the HF base model, its LoRA weights get seeded random values
(peft initializes B to zero, an adapter that changes nothing), and save_pretrained writes the format every engine
loads. The reference output is transformers with the adapter merged by peft (merge_and_unload)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 8,
                 targets: Sequence[str] = ALL_LINEAR, std: float = 0.02, alpha: int | None = None) -> Path:
    """A rank-`rank` LoRA adapter of the model in base_dir, written to out_dir; the same seed, the same adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return out_dir


def merged_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]],
                  max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens with the adapter merged into the base weights (None: the base model)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None  # every answer runs to max_new_tokens, as ignore_eos
    answers = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        answers.append(out[0, len(prompt):].tolist())
    return answers
