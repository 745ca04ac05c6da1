"""The Llama family in torch: RMSNorm, RoPE, grouped-query attention over the paged KV cache, SwiGLU.

Inputs are ragged: one flat run of tokens for the whole batch, with positions, no padding.
q/k/v and gate/up are fused into single projections (fewer, larger GEMMs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata
from kvfleet.engine.model_config import ModelConfig
from kvfleet.kernels import cpu_elementwise

Rope = tuple[torch.Tensor, torch.Tensor]  # cos and sin of a step's positions, [T, 1, head_dim / 2] each


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_elementwise.applies(x, self.weight):
            return cpu_elementwise.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x): the residual stream's next value and its normalized form. On CPUs
        in float32 and bfloat16 one fused pass writes the sum into `residual` (the stream is the model's own, never an
        input)."""
        if cpu_elementwise.applies(x, residual, self.weight):
            return cpu_elementwise.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return F.rms_norm(residual, (x.shape[-1],), self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """HF's rotate-half RoPE, cos/sin precomputed for every position up to max_positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin [T, 1, D/2] of each token's position: looked up once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [T, heads, D] rotated by the positions rope was looked up for."""
        cos, sin = rope
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.backend = backend

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        cos, sin = rope
        in_place = cpu_elementwise.applies(qkv, cos, sin)
        if in_place:  # q's and k's heads rotated in one pass
            cpu_elementwise.rotate_in_place(qkv, cos[:, 0], sin[:, 0], self.num_heads + self.num_kv_heads,
                                            self.head_dim)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if not in_place:
            q, k = RotaryEmbedding.rotate(q, rope), RotaryEmbedding.rotate(k, rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.backend.forward(self.layer, q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, to be added to the residual stream (None before the first layer, where x
        is the stream). Returns this layer's output and the stream, as vLLM's layers do: the add of one layer's
        output is fused with the next norm."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm.add_and_norm(x, residual)
        normed, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(rope, normed, meta), residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models read the embedding matrix unless a faster LM head is installed (see pack_linears).
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat ragged batch of T tokens."""
        x = self.embed_tokens(input_ids)  # a new tensor: the residual stream may be written in place
        rope = self.rotary.tables(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; complains about anything missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        q_size = self.config.num_attention_heads * self.config.head_dim
        kv_size = self.config.num_key_value_heads * self.config.head_dim
        inter = self.config.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            for part, (target, offset, size) in fused.items():
                if f".{part}." in name:
                    name = name.replace(f".{part}.", f".{target}.")
                    param = params[name]
                    param.data.narrow(0, offset, size).copy_(tensor)
                    loaded.add(f"{name}:{part}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r}: is this a Llama-family checkpoint?")
                params[name].data.copy_(tensor)
                loaded.add(name)
        expected: set[str] = set()
        for n in params:
            if ".qkv_proj." in n:
                expected |= {f"{n}:q_proj", f"{n}:k_proj", f"{n}:v_proj"}
            elif ".gate_up_proj." in n:
                expected |= {f"{n}:gate_proj", f"{n}:up_proj"}
            else:
                expected.add(n)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
