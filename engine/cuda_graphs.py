"""CUDA graphs for decode steps, as vLLM captures them: at start the model's forward pass for a decode-only batch
is captured once per batch size of a short ladder (1, 2, 4, then multiples of 8 up to --max-num-seqs); a decode
step of n sequences then copies its inputs into the graph's fixed buffers, padded to the next captured size, and
replays one graph instead of launching hundreds of kernels from Python. Prefill steps and larger batches run
eagerly. `--enforce-eager` turns it off (vLLM's flag).

Padding rows attend to one token of a spare block that the block manager never hands out, and write their K/V
there, so no sequence's cache is touched. Only the Triton backend is captured: its kernels read block tables and
sequence lengths on the GPU and never read anything back to the host.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata, DecodeGroup
from kvfleet.engine.sequence import Sequence

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs (itself included)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else [*sizes, top]


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n sequences; None when n is beyond them all (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """A decode step's inputs as host lists, padded to a captured size (pure: built without touching a GPU)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]


def decode_inputs(seqs: list[Sequence], size: int, block_size: int, width: int, pad_block: int) -> DecodeInputs:
    """Each sequence's next token at its position and cache slot, its block table padded to `width`; rows beyond
    the sequences read and write one token of `pad_block`."""
    ids, positions, slots, tables, lens = [], [], [], [], []
    for seq in seqs:
        pos = seq.num_computed_tokens
        table = seq.block_table
        ids.append(seq.token_ids_slice(pos, pos + 1)[0])
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables.append(table + [pad_block] * (width - len(table)))
        lens.append(pos + 1)
    for _ in range(size - len(seqs)):
        ids.append(0)
        positions.append(0)
        slots.append(pad_block * block_size)
        tables.append([pad_block] * width)
        lens.append(1)
    return DecodeInputs(ids, positions, slots, tables, lens)


class DecodeGraphs:
    """The captured graphs and their fixed input and output buffers."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_num_seqs: int, max_model_len: int,
                 pad_block: int) -> None:
        self.model, self.backend, self.pad_block = model, backend, pad_block
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = backend.block_size
        self.width = -(-max_model_len // self.block_size)  # blocks of the longest sequence
        top, device = self.sizes[-1], backend.device
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), pad_block * self.block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((top, self.width), pad_block, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        group = DecodeGroup(0, size, self.block_tables[:size], self.seq_lens[:size], self.block_size,
                            self.backend.dtype)
        return AttentionMetadata(slot_mapping=self.slots[:size], num_decode_tokens=size, decode_groups=[group],
                                 prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[])

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool (each graph's activations reuse the largest's)."""
        pool = None
        stream = torch.cuda.Stream(self.backend.device)
        stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                meta = self._meta(size)
                for _ in range(2):  # compiles the kernels, settles the allocator
                    self.model(self.input_ids[:size], self.positions[:size], meta)
                torch.cuda.synchronize(self.backend.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size], meta)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.current_stream(self.backend.device).wait_stream(stream)

    def run(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The hidden states [n, hidden] of a decode step of these sequences, by replay; None: run it eagerly."""
        size = padded_batch_size(len(seqs), self.sizes)
        if size is None or size not in self.graphs or any(len(s.block_table) > self.width for s in seqs):
            return None
        inputs = decode_inputs(seqs, size, self.block_size, self.width, self.pad_block)
        for buffer, values in ((self.input_ids, inputs.input_ids), (self.positions, inputs.positions),
                               (self.slots, inputs.slots), (self.seq_lens, inputs.seq_lens),
                               (self.block_tables, inputs.block_tables)):
            buffer[:size].copy_(torch.tensor(values, dtype=torch.long).pin_memory(), non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][: len(seqs)]
