"""Triton paged-attention decode vs the torch reference (GQA, ragged lengths, split-KV, dtypes)."""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.kernels.paged_attention import (
    default_num_splits,
    paged_attention_decode,
    paged_attention_decode_ref,
)

from bench.kernel_inputs import random_paged_kv

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None = None,
) -> None:
    kv = random_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype, device=device
    )
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    got = paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, num_splits=num_splits)
    ref = paged_attention_decode_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got).all(), "the kernel read cache positions outside a sequence"
    # absolute tolerance relative to the output's scale (long contexts average v down to small values)
    atol = TOL[dtype] * float(ref.float().abs().max())
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=TOL[dtype])


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_ragged_lengths(dtype: torch.dtype, group: int, device: torch.device) -> None:
    """Lengths 1, exactly one block, one past a block and several blocks; head_dim 24 is not a power of two."""
    check([1, 16, 17, 50], num_kv_heads=2, group=group, head_dim=24, block_size=16, dtype=dtype, device=device)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_kv_matches_reference(dtype: torch.dtype, num_splits: int, device: torch.device) -> None:
    """Flash-decoding splits, including splits that are empty for the short sequence."""
    check(
        [3, 130, 61],
        num_kv_heads=1,
        group=4,
        head_dim=32,
        block_size=8,
        dtype=dtype,
        device=device,
        num_splits=num_splits,
    )


def test_block_size_not_power_of_two_and_llama_head_dim(device: torch.device) -> None:
    check([7, 40], num_kv_heads=1, group=8, head_dim=128, block_size=12, dtype=torch.float16, device=device)


def test_default_num_splits_fills_the_device() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(1, 8, 32768, cpu) > 1
    assert default_num_splits(1, 8, 32768, cpu) <= 16
    assert default_num_splits(64, 8, 32768, cpu) == 1
    assert default_num_splits(1, 8, 100, cpu) == 1  # short contexts are never split


def test_bad_shapes_are_rejected(device: torch.device) -> None:
    kv = random_paged_kv([5], num_kv_heads=3, head_dim=16, block_size=4, dtype=torch.float32, device=device)
    q = torch.zeros(1, 4, 16, device=device)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(
            torch.zeros(1, 3, 16, device=device), kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens, 1.0
        )


@pytest.mark.gpu_large
@pytest.mark.parametrize("group", [1, 4, 8])
def test_large_batch_long_contexts(group: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 4096, (32,), generator=gen).tolist()
    check(lens, num_kv_heads=8, group=group, head_dim=128, block_size=16, dtype=torch.bfloat16, device=device)
