"""How many KV blocks fit, and whether one max_model_len sequence does (pure arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.fleet.sizes import format_size


class KVCacheTooSmallError(ValueError):
    """One sequence of max_model_len tokens cannot fit in the KV cache."""


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens that fit at once."""
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        return self.num_blocks / blocks_per_seq

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks:,} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens "
            f"({format_size(self.num_bytes)}); {self.max_concurrency:.2f} sequences of max_model_len "
            f"{self.max_model_len:,} fit at once"
        )


def plan_kv_cache(memory_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int,
                  memory_flag: str = "--kv-cache-memory") -> KVCapacity:
    """Blocks for memory_bytes of cache; refuses, suggesting a max_model_len that fits, when one sequence can't."""
    capacity = KVCapacity(max(memory_bytes // bytes_per_block, 0), block_size, bytes_per_block, max_model_len)
    if capacity.num_tokens < max_model_len:
        needed = -(-max_model_len // block_size) * bytes_per_block
        if capacity.num_tokens == 0:
            raise KVCacheTooSmallError(
                f"the KV cache ({format_size(memory_bytes)}) does not hold a single block of {block_size} "
                f"tokens ({format_size(bytes_per_block)}); give it more memory with {memory_flag}"
            )
        raise KVCacheTooSmallError(
            f"max_model_len {max_model_len:,} does not fit in the KV cache ({capacity.num_tokens:,} tokens); "
            f"use --max-model-len {capacity.num_tokens} or give the cache more memory "
            f"({memory_flag}; {format_size(needed)} holds one sequence of {max_model_len:,} tokens)"
        )
    return capacity
