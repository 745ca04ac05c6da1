"""Turns a scheduled batch into flat tensors, runs the model, and returns logits for the sequences to sample."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata, DecodeGroup
from kvfleet.engine.cuda_graphs import DecodeGraphs
from kvfleet.engine.lora_layers import LoraSlots
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.sequence import Sequence
from kvfleet.kernels.lora import plan_lora


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last token of each sequence whose tokens are all computed after this step
    sample_sequences: list[Sequence]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
                 graphs: DecodeGraphs | None = None, lora: LoraSlots | None = None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = backend.block_size
        self.device = device
        self.group_blocks = backend.decode_group_blocks
        self.graphs = graphs  # decode steps by CUDA-graph replay (engine/cuda_graphs.py); None: always eager
        self.last_prepare_s = 0.0  # the latest step's time building its inputs (engine/step_profile.py)
        self.lora = lora  # the adapters' slots (engine/lora_layers.py); each sequence's adapter is in one already

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """One forward pass; returns the sequences that get a new token and their float32 logits."""
        started = time.perf_counter()
        if self.graphs is not None and all(n == 1 for _, n in scheduled):
            decodes = sorted((seq for seq, _ in scheduled), key=lambda seq: len(seq.block_table))
            hidden = self.graphs.run(decodes)
            if hidden is not None:
                self.last_prepare_s = 0.0  # inside the replay
                return decodes, self.model.compute_logits(hidden)
        batch = self.prepare(scheduled)
        self.last_prepare_s = time.perf_counter() - started
        try:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        finally:
            if self.lora is not None:
                self.lora.step.plan = None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return batch.sample_sequences, logits

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> BatchInputs:
        # Decode sequences sorted by length, so that each attention group pads only to similar lengths; with adapters,
        # by adapter slot first, so that each adapter's decode tokens are one run (kernels/lora.py works on views).
        decodes = sorted(((seq, n) for seq, n in scheduled if n == 1), key=self._decode_order)
        prefills = [(seq, n) for seq, n in scheduled if n != 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sample_sequences: list[Sequence] = []
        bs = self.block_size
        for seq, n in ordered:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids_slice(start, start + n))
            table = seq.block_table
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            if start + n == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sample_sequences.append(seq)
        if self.lora is not None:
            self.lora.step.plan = plan_lora(self._token_slots(ordered), self.device)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decodes),
            decode_groups=self._decode_groups(decodes),
            prefill_query_lens=[n for _, n in prefills],
            prefill_context_lens=[seq.num_computed_tokens for seq, _ in prefills],
            prefill_block_tables=[self._tensor(seq.block_table) for seq, _ in prefills],
        )
        return BatchInputs(self._tensor(input_ids), self._tensor(positions), meta,
                           self._tensor(logits_indices), sample_sequences)

    def _decode_order(self, item: tuple[Sequence, int]) -> tuple[int, int]:
        seq = item[0]
        slot = None if self.lora is None or seq.lora is None else self.lora.slot_of(seq.lora.id)
        return -1 if slot is None else slot, len(seq.block_table)

    def _token_slots(self, ordered: list[tuple[Sequence, int]]) -> list[int]:
        """Each token's adapter slot, in the batch's token order (-1: the base model)."""
        slots: list[int] = []
        for seq, n in ordered:
            slot = -1 if seq.lora is None else self.lora.slot_of(seq.lora.id)
            if slot is None:
                raise RuntimeError(f"request {seq.request_id}'s adapter {seq.lora.name!r} is in no slot")
            slots += [slot] * n
        return slots

    def _decode_groups(self, decodes: list[tuple[Sequence, int]]) -> list[DecodeGroup]:
        """Cut the length-sorted decode sequences into groups whose padded K/V stays cache-sized."""
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(decodes):
            end = start + 1
            while end < len(decodes) and (end + 1 - start) * len(decodes[end][0].block_table) <= self.group_blocks:
                end += 1
            groups.append(self._decode_group(decodes, start, end))
            start = end
        return groups

    def _decode_group(self, decodes: list[tuple[Sequence, int]], start: int, end: int) -> DecodeGroup:
        members = [seq for seq, _ in decodes[start:end]]
        width = max(len(seq.block_table) for seq in members)
        tables = self._tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in members])
        seq_lens = self._tensor([seq.num_computed_tokens + 1 for seq in members])
        return DecodeGroup(start, end, tables, seq_lens, self.block_size, self.backend.dtype)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
