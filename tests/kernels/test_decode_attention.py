"""The paged decode attention kernel agrees with its torch reference (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels.decode_attention import (
    MIN_SPLIT_TOKENS,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from tests.support.paged_cases import (
    BLOCK_SIZES,
    CONTEXT_LENS,
    HEAD_DIMS,
    QUERIES_PER_KV_HEAD,
    block_tables_for,
    decode_case,
    kv_heads_for,
    num_blocks_for,
    random_caches,
)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", QUERIES_PER_KV_HEAD)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mixed_context_lengths_with_a_cached_prefix_match_the_reference(head_dim: int, group: int,
                                                                        block_size: int) -> None:
    torch.manual_seed(head_dim + group + block_size)
    q, k_cache, v_cache, tables, seq_lens = decode_case(list(CONTEXT_LENS), block_size, head_dim,
                                                        kv_heads_for(group), group, shared_prefix_blocks=1)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    for num_splits in (1, 4):  # 4 asks for splits of 128 tokens (3 cover 257); shorter sequences leave some empty
        out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, num_splits=num_splits)
        assert (out - expected).abs().max().item() <= 1e-4, f"{num_splits} splits"


def test_float16_matches_the_float32_reference_loosely() -> None:
    torch.manual_seed(0)
    lengths = [1, 17, 257]
    tables = block_tables_for(lengths, 16)
    k_cache, v_cache = random_caches(1, num_blocks_for(tables), 16, 128, torch.float16)
    q = torch.randn(len(lengths), 8, 128, dtype=torch.float16)
    seq_lens = torch.tensor(lengths)
    expected = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens,
                                                128**-0.5)
    out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128**-0.5, num_splits=2)
    assert out.dtype == torch.float16
    assert (out.float() - expected).abs().max().item() <= 1e-2


def test_split_count_fills_the_gpu_only_when_the_batch_cannot() -> None:
    assert choose_num_splits(num_programs=4, max_context=8192, num_sms=132) == 32  # capped at MAX_SPLITS
    assert choose_num_splits(num_programs=64, max_context=8192, num_sms=132) == 5
    assert choose_num_splits(num_programs=768, max_context=8192, num_sms=132) == 1
    assert choose_num_splits(num_programs=1, max_context=3 * MIN_SPLIT_TOKENS, num_sms=132) == 3
    assert choose_num_splits(num_programs=1, max_context=16, num_sms=132) == 1
