"""The C++ CPU paged decode attention against the torch path (gather the blocks, masked SDPA)."""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.model.attention import _torch_decode
from lorafleet_worker.model.forward_batch import ForwardBatch
from lorafleet_worker.ops import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU decode attention does not build")


def decode_batch(seq_lens: list[int], block_tables: torch.Tensor, block_size: int, window: int | None) -> ForwardBatch:
    n = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=(lens - 1).long(),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        num_decode=n,
        decode_block_tables=block_tables,
        decode_seq_lens=lens,
        prefills=[],
        logits_indices=torch.arange(n),
    )
    batch.prepare_masks(block_size, window)
    return batch


def scattered_block_tables(seq_lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Each sequence's blocks scattered over the pool (never block 0), tables padded with block 0."""
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([perm.pop() for _ in range(need)] + [0] * (width - need))
    return torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_matches_torch_decode(heads: int, kv_heads: int, dtype: torch.dtype, tol: float, window: int | None) -> None:
    torch.manual_seed(0)
    block_size, head_dim, num_blocks = 4, 16, 40
    seq_lens = [1, 5, 4, 13, 30]  # one token, a partial block, a full block, several blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    block_tables = scattered_block_tables(seq_lens, block_size, num_blocks)
    q = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    batch = decode_batch(seq_lens, block_tables, block_size, window)

    ours = cpu_attention.paged_decode(q, k_cache, v_cache, block_tables, batch.decode_seq_lens, scale, window)
    ref = _torch_decode(q.float(), k_cache.float(), v_cache.float(), batch, scale)
    assert ours.dtype == dtype and ours.shape == q.shape
    assert (ours.float() - ref).abs().max().item() < tol


def test_only_the_sequence_blocks_are_read() -> None:
    """NaN in every block no sequence owns (including the padding block 0) changes nothing."""
    torch.manual_seed(1)
    k_cache = torch.full((8, 4, 2, 8), float("nan"))
    v_cache = torch.full((8, 4, 2, 8), float("nan"))
    k_cache[3, :2], v_cache[3, :2] = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    q = torch.randn(1, 2, 8)
    out = cpu_attention.paged_decode(q, k_cache, v_cache, torch.tensor([[3, 0]], dtype=torch.int32),
                                     torch.tensor([2], dtype=torch.int32), 0.5, None)  # fmt: skip
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# 12: the portable loops; 32: the AVX-512 ones where built; 64 and 128: the register-resident path per KV head
@pytest.mark.parametrize("head_dim", [12, 32, 64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 17])  # few sequences split their KV heads over threads; many do not
def test_head_dims_and_work_splits(head_dim: int, num_seqs: int, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(2)
    heads, kv_heads, block_size, num_blocks = 8, 4, 8, 96
    # lengths around block boundaries: 1 token, a block less one, a block, a block plus one, several blocks
    seq_lens = [[1, 7, 8, 9, 23, 40, 41][i % 7] for i in range(num_seqs)]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    block_tables = scattered_block_tables(seq_lens, block_size, num_blocks)
    q = torch.randn(num_seqs, heads, head_dim).to(dtype)
    batch = decode_batch(seq_lens, block_tables, block_size, None)
    ours = cpu_attention.paged_decode(q, k_cache, v_cache, block_tables, batch.decode_seq_lens, 0.3, None)
    ref = _torch_decode(q.float(), k_cache.float(), v_cache.float(), batch, 0.3)
    assert (ours.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("group", [1, 2, 3, 5, 8, 9])  # query heads per KV head; 9: past the fast path's 8
def test_query_groups_of_the_fast_path(group: int, window: int | None) -> None:
    torch.manual_seed(3)
    kv_heads, head_dim, block_size, num_blocks = 2, 64, 16, 64
    seq_lens = [1, 15, 16, 17, 60, 130]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    block_tables = scattered_block_tables(seq_lens, block_size, num_blocks)
    q = torch.randn(len(seq_lens), group * kv_heads, head_dim)
    batch = decode_batch(seq_lens, block_tables, block_size, window)
    ours = cpu_attention.paged_decode(q, k_cache, v_cache, block_tables, batch.decode_seq_lens, 0.125, window)
    ref = _torch_decode(q, k_cache, v_cache, batch, 0.125)
    assert (ours - ref).abs().max().item() < 1e-5


# 6 tokens: the scalar softmax; 13: eight vector lanes and a scalar tail; head dim 64: the per-KV-head fast path
@pytest.mark.parametrize(("length", "head_dim"), [(6, 16), (13, 16), (13, 64)])
def test_large_score_range_stays_finite(length: int, head_dim: int) -> None:
    """The softmax's exp sees scores far below the max (underflow to 0, never NaN)."""
    k_cache = torch.zeros(4, 4, 1, head_dim)
    v_cache = torch.randn(4, 4, 1, head_dim)
    k_cache[1, 0, 0] = 100.0  # one key scores far above the others
    q = torch.ones(1, 1, head_dim)
    out = cpu_attention.paged_decode(q, k_cache, v_cache, torch.tensor([[1, 2, 3, 0]], dtype=torch.int32),
                                     torch.tensor([length], dtype=torch.int32), 1.0, None)  # fmt: skip
    assert torch.allclose(out[0, 0], v_cache[1, 0, 0], atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_is_the_ops_it_fuses(
    dtype: torch.dtype, tol: float, window: int | None, qk_norm: bool
) -> None:
    """`decode_attention` on a qkv projection = per-head q/k RMSNorm, RoPE, the cache writes and the decode
    attention done op by op with torch (RMSNorm module, apply_rope, index_copy_, gather + masked SDPA)."""
    from lorafleet_worker.model.rope import apply_rope
    from lorafleet_worker.model.transformer import RMSNorm

    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 40
    seq_lens = [1, 5, 13, 30]
    n = len(seq_lens)
    block_tables = scattered_block_tables(seq_lens, block_size, num_blocks)
    batch = decode_batch(seq_lens, block_tables, block_size, window)
    # each new token goes to the slot of its position (the last one of its sequence)
    pos = [s - 1 for s in seq_lens]
    batch.slot_mapping = torch.tensor([int(block_tables[i, p // block_size]) * block_size + p % block_size
                                       for i, p in enumerate(pos)], dtype=torch.int64)  # fmt: skip
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.randn(n, head_dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)[:, None, :]  # [T, 1, D], as rope_cos_sin
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)[:, None, :]
    norms = None
    if qk_norm:
        norms = (RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6))
        for m in norms:
            m.weight.data = (1 + 0.1 * torch.randn(head_dim)).to(dtype)
    scale = head_dim**-0.5

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim), v.reshape(n, kv_heads, head_dim)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_ref.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_ref.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    ref = _torch_decode(q.float(), k_ref.float(), v_ref.float(), batch, scale).reshape(n, heads * head_dim)

    ours = cpu_attention.decode_attention(
        qkv, cos, sin, None if norms is None else norms[0].weight, None if norms is None else norms[1].weight,
        1e-6, k_cache, v_cache, batch, heads, scale, window,
    )  # fmt: skip
    assert ours.dtype == dtype and ours.shape == (n, heads * head_dim)
    assert (ours.float() - ref).abs().max().item() < tol
    assert (k_cache.float() - k_ref.float()).abs().max().item() < tol  # the roped keys, written at their slots
    assert torch.equal(v_cache, v_ref)


def test_decode_attention_refuses_a_slot_outside_the_cache() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    batch = decode_batch([1], torch.tensor([[1]], dtype=torch.int32), 4, None)
    batch.slot_mapping = torch.tensor([8])  # 2 blocks x 4 slots: 8 is one past the end
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_attention.decode_attention(torch.zeros(1, 24), cos, sin, None, None, 0.0, k_cache, k_cache.clone(),
                                       batch, 1, 1.0, None)  # fmt: skip
