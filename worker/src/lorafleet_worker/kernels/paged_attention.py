"""Paged-attention decode: one query token per sequence over its KV blocks (Triton kernel + torch reference).

KV cache per layer (`kv_cache.py`): `k_cache`, `v_cache` `[num_blocks, block_size, num_kv_heads, head_dim]`;
token `p` of sequence `b` lives in block `block_tables[b, p // block_size]` at offset `p % block_size`.

A program handles one (sequence, kv head, split): the `GROUP = num_q_heads / num_kv_heads` query heads that
share the kv head are one tile (GQA: K/V are read once per group), the context is walked BLOCK_N tokens at
a time with an online softmax in fp32. When sequences x kv heads are too few to fill the GPU, the context is
split into `num_splits` chunks (flash-decoding) whose partial results a second kernel combines.

Block sizes: BLOCK_G = next pow2 of GROUP (at least 16, the `tl.dot` minimum), BLOCK_D = next pow2 of
head_dim (at least 16); BLOCK_N tokens per step and warps (`attention_blocks`), the largest tiles that compile
for sm_90 without register spills (ptxas -v), never above the padded chunk:

    BLOCK_D      2-byte dtypes        fp32
    <= 64        64 tokens, 4 warps   32 tokens, 4 warps
    128          64 tokens, 8 warps   16 tokens, 4 warps
    256          32 tokens, 8 warps   16 tokens, 8 warps

Splits: enough programs for ~2 waves on the device's SMs, each split at least 256 tokens, at most 16.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from lorafleet_worker.kernels import LazyKernel, check_device, dot_operands_fp32, dot_precision

MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16
_LOG2E = 1.4426950408889634


def _attn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,
    block_size,
    head_dim,
    chunk,
    num_splits,
    stride_q_b,
    stride_q_h,
    stride_k_blk,
    stride_k_pos,
    stride_k_h,
    stride_v_blk,
    stride_v_pos,
    stride_v_h,
    stride_bt,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """grid (B, num_kv_heads, num_splits). SPLIT: write fp32 partials (acc, m, l) instead of the output."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_G,), 0.0, tl.float32)
    acc = tl.full((BLOCK_G, BLOCK_D), 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        phys = tl.load(block_tables_ptr + b * stride_bt + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        in_blk = pos % block_size
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + (phys * stride_k_blk + in_blk * stride_k_pos + kvh * stride_k_h)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + (phys * stride_v_blk + in_blk * stride_v_pos + kvh * stride_v_h)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 domain
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o_ptrs = o_ptr + b * stride_o_b + heads[:, None] * stride_o_h + split * stride_o_s + offs_d[None, :]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        ml_off = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(m_ptr + ml_off, m_i, mask=g_mask)
        tl.store(l_ptr + ml_off, l_i, mask=g_mask)
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)


def _attn_combine_kernel(
    part_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    num_splits,
    head_dim,
    stride_o_b,
    stride_o_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grid (B, num_q_heads): merge the splits' partial softmax results (log2 domain) into the output."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    m = tl.load(m_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    l_ = tl.load(l_ptr + row * num_splits + offs_s, mask=s_mask, other=0.0)
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    w = tl.where(l_ > 0, tl.exp2(m - m_max), 0.0)
    part = tl.load(
        part_ptr + (row * num_splits + offs_s)[:, None] * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.reduce(w * l_, 0, tl.standard._sum_combine)
    out = tl.reduce(part * w[:, None], 0, tl.standard._sum_combine) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + b * stride_o_b + h * stride_o_h + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


attn_decode_kernel = LazyKernel(_attn_decode_kernel)
attn_combine_kernel = LazyKernel(_attn_combine_kernel)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: behave like an H100


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Context splits so that batch x kv heads x splits fills ~2 waves, each split >= MIN_SPLIT_TOKENS."""
    programs = batch * num_kv_heads
    want = math.ceil(2 * _sm_count(device) / max(programs, 1))
    return max(1, min(want, MAX_SPLITS, max_context // MIN_SPLIT_TOKENS))


def attention_blocks(head_dim: int, dtype: torch.dtype, chunk: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel (the table in the module docstring)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_n, warps = (32, 4) if block_d <= 64 else (16, 4 if block_d <= 128 else 8)
    else:
        block_n, warps = (64, 4) if block_d <= 64 else ((64, 8) if block_d <= 128 else (32, 8))
    return max(16, min(block_n, triton.next_power_of_2(chunk))), warps


def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> Tensor:
    """Attention of one query per sequence (q [B, num_q_heads, head_dim]) over its paged K/V; returns q-shaped.

    `block_tables` int32 [B, max_blocks] (padded), `seq_lens` int32 [B] (>= 1, including the new token).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or kv_dim != head_dim:
        raise ValueError(f"k/v cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.shape[0] != batch:
        raise ValueError("block_tables int32 [B, max_blocks] and seq_lens int32 [B] are required")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache and block_tables need a contiguous last dim")
    check_device(q, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    splits = num_splits or default_num_splits(batch, num_kv_heads, max_context, q.device)
    chunk = triton.cdiv(max_context, splits)
    block_n, num_warps = attention_blocks(head_dim, q.dtype, chunk)
    chunk = triton.cdiv(chunk, block_n) * block_n
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        m = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        dest, o_strides = part, (part.stride(0), part.stride(1), part.stride(2))
    else:
        m = lsum = out  # unused
        dest, o_strides = out, (out.stride(0), out.stride(1), 0)
    attn_decode_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        dest,
        m,
        lsum,
        block_tables,
        seq_lens,
        scale * _LOG2E,
        block_size,
        head_dim,
        chunk,
        splits,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *o_strides,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=splits > 1,
        DOT_FP32=dot_operands_fp32(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )
    if splits > 1:
        attn_combine_kernel[(batch, num_heads)](
            part,
            m,
            lsum,
            out,
            splits,
            head_dim,
            out.stride(0),
            out.stride(1),
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
        )
    return out


def paged_attention_decode_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Torch reference of `paged_attention_decode` (fp32 math, one sequence at a time)."""
    batch, num_heads = q.shape[0], q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
