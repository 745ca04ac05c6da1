"""Multi-LoRA inside the model: every projection of every layer gains stacked A and B buffers with one slot per adapter
a step may use (--max-loras), and adds each token's adapter update after its base GEMM (kernels/lora.py).

The engine fuses q/k/v and gate/up into one GEMM each; an adapter's q, k and v updates share that layer's slot:
their A matrices stacked by rank, their B matrices on the block diagonal, so one shrink and one expand serve all
three (a projection the adapter does not target stays zero). B carries the adapter's scaling. Loading an adapter
into a slot copies its weights in once; a slot goes to the adapter that waited longest for one, evicting the least
recently used adapter that the step does not need (vLLM's LRU of GPU LoRA slots).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from kvfleet.engine.lora_adapter import LoraAdapter, projection_shapes
from kvfleet.engine.model_config import ModelConfig
from kvfleet.kernels.lora import LoraPlan, lora_update

# Each of the engine's linear layers and the adapter projections it fuses, in the order of its output features.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}
_PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


@dataclass
class LoraStep:
    """The current step's plan, set by the model runner before each forward and read by every LoraLinear."""

    plan: LoraPlan | None = None


class LoraLinear(nn.Module):
    """A linear layer (plain or prepacked) and its adapters' stacked weights: a [slots, rank, in],
    b [slots, out, rank]."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, step: LoraStep) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.step.plan is not None:
            lora_update(y, x, self.a, self.b, self.step.plan)
        return y


class LoraSlots:
    """The slots of stacked adapter weights in a model, and which adapter (by LoraSpec id) each holds."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.step = LoraStep()
        self.layers: dict[tuple[int, str], LoraLinear] = {}
        self._holders: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.loads = 0  # adapters copied into a slot
        shapes = projection_shapes(config)
        for index, layer in enumerate(model.layers):
            for fused, parts in FUSED.items():
                parent = getattr(layer, _PARENT[fused])
                d_in = shapes[parts[0]][0]
                d_out = sum(shapes[p][1] for p in parts)
                rank = max_rank * len(parts)
                options = {"dtype": dtype, "device": device}
                wrapped = LoraLinear(getattr(parent, fused), torch.zeros(max_loras, rank, d_in, **options),
                                     torch.zeros(max_loras, d_out, rank, **options), self.step)
                setattr(parent, fused, wrapped)
                self.layers[(index, fused)] = wrapped
        self._shapes = shapes

    @property
    def held(self) -> list[int]:
        """The adapter ids in slots now."""
        return list(self._holders)

    def slot_of(self, adapter_id: int) -> int | None:
        return self._holders.get(adapter_id)

    def activate(self, adapters: dict[int, LoraAdapter]) -> dict[int, int]:
        """Put each of these adapters (by id; at most max_loras) in a slot, loading those not there yet; their
        slots by id. Slots of adapters not asked for are taken least recently used first."""
        if len(adapters) > self.max_loras:
            raise ValueError(f"{len(adapters)} adapters in one step; --max-loras is {self.max_loras}")
        for adapter_id in adapters:
            if adapter_id in self._holders:
                self._holders.move_to_end(adapter_id)
        for adapter_id, adapter in adapters.items():
            if adapter_id not in self._holders:
                self._holders[adapter_id] = self._free_slot(set(adapters))
                self._load(self._holders[adapter_id], adapter)
        return {adapter_id: self._holders[adapter_id] for adapter_id in adapters}

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter's slot becomes free (its weights stay until overwritten)."""
        self._holders.pop(adapter_id, None)

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self._holders.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(adapter_id for adapter_id in self._holders if adapter_id not in needed)
        return self._holders.pop(victim)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for (index, fused), layer in self.layers.items():
            a, b = layer.a[slot], layer.b[slot]
            a.zero_()
            b.zero_()
            out = 0
            for i, part in enumerate(FUSED[fused]):
                d_out = self._shapes[part][1]
                weights = adapter.weights.get((index, part))
                if weights is not None:
                    lora_a, lora_b = weights
                    rank, column = lora_a.shape[0], i * self.max_rank
                    a[column:column + rank].copy_(lora_a)
                    b[out:out + d_out, column:column + rank].copy_(lora_b * adapter.scaling)
                out += d_out
        self.loads += 1

