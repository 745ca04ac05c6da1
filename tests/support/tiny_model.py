"""A tiny random-weight Llama in HF format, built by the tests (real transformers code, no download)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_CONFIG = dict(
    hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
)


def build_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random 3-layer GQA Llama (6 query heads of 16, 2 KV heads) with SmolLM2's tokenizer into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in tokenizer_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(name, out_dir / name.name)
    torch.manual_seed(seed)
    vocab = 49152
    config = LlamaConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **TINY_CONFIG)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init make the logits decisive
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.15)
    model.save_pretrained(out_dir)
    return out_dir
