"""Triton multi-LoRA kernels: shrink (`xa = x · Aᵀ`) and expand (`out += scaling · xa · Bᵀ`).

One shrink launch and one expand launch per projection cover every adapter of the batch and every slice of a
fused projection (q/k/v with their GQA widths, gate/up). Weights are the slot pool's stacked buffers
(`LoRAProjWeights`, `lora/weights.py`):

    A        [num_slots, n_slices, max_rank, in_dim]    B  [num_slots, out_total, max_rank]
    ranks    int32 [num_slots, n_slices]                scalings  float32 [num_slots, n_slices]
    slice_offsets  int32 [n_slices + 1] (on the device), slice s = columns offsets[s]:offsets[s+1] of `out`

The intermediate `xa` is float32 `[T, n_slices, max_rank]`, indexed by the original token id; only the
entries `r < ranks[slot, s]` of tokens with a slot are written, and only those are read.

Two layouts:

* segmented (prefill): tokens grouped by slot (`sorted_token_ids`, `seg_indptr`, `seg_slots`); a program
  multiplies a tile of up to BLOCK_M tokens of one segment with `tl.dot`.
* gathered (decode): one program per token reads its own slot (`token_slots`, -1 = no adapter) and does a
  GEMV with vector products, which needs no minimum tile of tokens.

The rank is read inside the kernels: shrink programs whose rank block starts at or beyond the adapter's rank
exit at once, and expand loops over the rank only up to it, so a rank-8 adapter costs rank-8 work in a
batch whose max rank is 64. Tokens with slot -1 and slices with rank 0 get no delta. Accumulation is fp32.

Block sizes (`shrink_blocks` / `expand_blocks`), powers of two, at least 16 where `tl.dot` needs it; "x -> [lo, hi]"
is the next power of two of x clamped to [lo, hi]; the upper bounds are the largest tiles that compile for sm_90
with 4 warps and no register spills (ptxas -v):

    kernel            BLOCK_M               BLOCK_R   BLOCK_K / BLOCK_N (2-byte dtypes | fp32)
    shrink segmented  seg len -> [16, 64]   16        in_dim -> [16, 64]  | [16, 32]
    expand segmented  seg len -> [16, 64]   16        slice width -> [16, 64] | [16, 32]
    shrink gathered   -                     16        in_dim -> [16, 256] | [16, 128]
    expand gathered   -                     16        slice width -> [16, 128]

BLOCK_R = 16 keeps the wasted work of a small rank within one 16-wide block; the segmented BLOCK_M follows
the longest segment so that short (decode-like) segments do not pad to 64 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from lorafleet_worker.kernels import LazyKernel, check_device, dot_operands_fp32, dot_precision

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


@dataclass(frozen=True)
class ShrinkBlocks:
    BLOCK_M: int
    BLOCK_R: int
    BLOCK_K: int
    num_warps: int = 4


@dataclass(frozen=True)
class ExpandBlocks:
    BLOCK_M: int
    BLOCK_R: int
    BLOCK_N: int
    num_warps: int = 4


def shrink_blocks(*, in_dim: int, max_seg_len: int, dtype: torch.dtype, gathered: bool) -> ShrinkBlocks:
    """Block sizes of the shrink kernels (the table in the module docstring)."""
    wide = dtype != torch.float32
    if gathered:
        return ShrinkBlocks(1, 16, _pow2_clamp(in_dim, 16, 256 if wide else 128))
    return ShrinkBlocks(_pow2_clamp(max_seg_len, 16, 64), 16, _pow2_clamp(in_dim, 16, 64 if wide else 32))


def expand_blocks(*, max_width: int, max_seg_len: int, dtype: torch.dtype, gathered: bool) -> ExpandBlocks:
    """Block sizes of the expand kernels (the table in the module docstring)."""
    if gathered:
        return ExpandBlocks(1, 16, _pow2_clamp(max_width, 16, 128))
    wide = dtype != torch.float32
    return ExpandBlocks(_pow2_clamp(max_seg_len, 16, 64), 16, _pow2_clamp(max_width, 16, 64 if wide else 32))


def _shrink_segmented_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    ranks_ptr,
    sorted_ids_ptr,
    seg_indptr_ptr,
    seg_slots_ptr,
    in_dim,
    n_slices,
    num_r_blocks,
    stride_x_t,
    stride_a_slot,
    stride_a_slice,
    stride_a_rank,
    stride_xa_t,
    stride_xa_s,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """grid (m blocks x rank blocks, n_slices, segments): xa[tok, s, r-block] of one segment's token tile."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    seg = tl.program_id(2)
    pid_m = pid // num_r_blocks
    r0 = (pid % num_r_blocks) * BLOCK_R
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.load(ranks_ptr + slot * n_slices + s)
    start = tl.load(seg_indptr_ptr + seg)
    seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    if (pid_m * BLOCK_M >= seg_len) | (r0 >= rank):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot * stride_a_slot + s * stride_a_slice
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_dim
        xt = tl.load(x_ptr + tok[:, None] * stride_x_t + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(
            a_base + offs_r[None, :] * stride_a_rank + k[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0
        )
        if DOT_FP32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    xa_ptrs = xa_ptr + tok[:, None] * stride_xa_t + s * stride_xa_s + offs_r[None, :]
    tl.store(xa_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


def _expand_segmented_kernel(
    xa_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    scalings_ptr,
    slice_off_ptr,
    sorted_ids_ptr,
    seg_indptr_ptr,
    seg_slots_ptr,
    n_slices,
    num_n_blocks,
    stride_xa_t,
    stride_xa_s,
    stride_b_slot,
    stride_b_row,
    stride_out_t,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """grid (m blocks x n blocks, n_slices, segments): out[tok, slice cols] += scaling * xa @ B[slot]ᵀ."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    seg = tl.program_id(2)
    pid_m = pid // num_n_blocks
    n0 = (pid % num_n_blocks) * BLOCK_N
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.load(ranks_ptr + slot * n_slices + s)
    start = tl.load(seg_indptr_ptr + seg)
    seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    col0 = tl.load(slice_off_ptr + s)
    width = tl.load(slice_off_ptr + s + 1) - col0
    if (pid_m * BLOCK_M >= seg_len) | (n0 >= width) | (rank <= 0):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    cols = col0 + offs_n
    b_base = b_ptr + slot * stride_b_slot
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        xt = tl.load(
            xa_ptr + tok[:, None] * stride_xa_t + s * stride_xa_s + offs_r[None, :],
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        bt = tl.load(
            b_base + cols[None, :] * stride_b_row + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0
        )
        if DOT_FP32:
            bt = bt.to(tl.float32)
        else:
            xt = xt.to(bt.dtype)
        acc += tl.dot(xt, bt, input_precision=PRECISION)
    scaling = tl.load(scalings_ptr + slot * n_slices + s)
    out_ptrs = out_ptr + tok[:, None] * stride_out_t + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    cur = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (cur + acc * scaling).to(out_ptr.dtype.element_ty), mask=mask)


def _shrink_gathered_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    ranks_ptr,
    token_slots_ptr,
    in_dim,
    n_slices,
    stride_x_t,
    stride_a_slot,
    stride_a_slice,
    stride_a_rank,
    stride_xa_t,
    stride_xa_s,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """grid (tokens, rank blocks, n_slices): xa[t, s, r-block] = A[slot(t), s, r-block] · x[t]."""
    t = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BLOCK_R
    s = tl.program_id(2)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot * n_slices + s)
    if r0 >= rank:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot * stride_a_slot + s * stride_a_slice
    # Element-wise products accumulate in a [BLOCK_R, BLOCK_K] tile and are summed once after the loop: a
    # cross-lane reduction per K step would serialise the loop on shuffles.
    acc = tl.full((BLOCK_R, BLOCK_K), 0.0, tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_dim
        xv = tl.load(x_ptr + t * stride_x_t + k, mask=k_mask, other=0.0).to(tl.float32)
        at = tl.load(
            a_base + offs_r[:, None] * stride_a_rank + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0
        )
        acc += at.to(tl.float32) * xv[None, :]
    xa = tl.reduce(acc, 1, tl.standard._sum_combine)
    tl.store(xa_ptr + t * stride_xa_t + s * stride_xa_s + offs_r, xa, mask=r_mask)


def _expand_gathered_kernel(
    xa_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    scalings_ptr,
    slice_off_ptr,
    token_slots_ptr,
    n_slices,
    stride_xa_t,
    stride_xa_s,
    stride_b_slot,
    stride_b_row,
    stride_out_t,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """grid (tokens, n blocks, n_slices): out[t, slice cols] += scaling * B[slot(t), cols] · xa[t, s]."""
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    s = tl.program_id(2)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot * n_slices + s)
    col0 = tl.load(slice_off_ptr + s)
    width = tl.load(slice_off_ptr + s + 1) - col0
    if (n0 >= width) | (rank <= 0):
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    cols = col0 + offs_n
    b_base = b_ptr + slot * stride_b_slot
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        xv = tl.load(xa_ptr + t * stride_xa_t + s * stride_xa_s + offs_r, mask=r_mask, other=0.0)
        bt = tl.load(
            b_base + cols[:, None] * stride_b_row + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        )
        acc += tl.reduce(bt.to(tl.float32) * xv[None, :], 1, tl.standard._sum_combine)
    scaling = tl.load(scalings_ptr + slot * n_slices + s)
    out_ptrs = out_ptr + t * stride_out_t + cols
    cur = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (cur + acc * scaling).to(out_ptr.dtype.element_ty), mask=n_mask)


shrink_segmented_kernel = LazyKernel(_shrink_segmented_kernel)
expand_segmented_kernel = LazyKernel(_expand_segmented_kernel)
shrink_gathered_kernel = LazyKernel(_shrink_gathered_kernel)
expand_gathered_kernel = LazyKernel(_expand_gathered_kernel)


# ----------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class Segments:
    """Tokens grouped by slot (the segmented layout; see `LoRABatchInfo`)."""

    sorted_token_ids: Tensor  # int32 [T]
    seg_indptr: Tensor  # int32 [S + 1]
    seg_slots: Tensor  # int32 [S], every slot >= 0
    max_seg_len: int

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]


def _check_rows(name: str, t: Tensor, width: int) -> None:
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(f"{name} must be [T, {width}] with contiguous rows, got {tuple(t.shape)} / {t.stride()}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: unsupported dtype {t.dtype} (float16, bfloat16 or float32)")


def _check_weights(a_or_b: Tensor, ranks: Tensor, dims: int) -> None:
    if a_or_b.dim() != dims or a_or_b.stride(-1) != 1:
        raise ValueError(f"LoRA weights must be {dims}-d with a contiguous last dim, got {tuple(a_or_b.shape)}")
    if ranks.dtype != torch.int32 or not ranks.is_contiguous():
        raise ValueError("ranks must be a contiguous int32 tensor [num_slots, n_slices]")


def _check_xa(xa: Tensor, num_tokens: int, n_slices: int, max_rank: int) -> None:
    if xa.dtype != torch.float32 or xa.shape != (num_tokens, n_slices, max_rank) or xa.stride(2) != 1:
        raise ValueError(f"xa must be float32 [{num_tokens}, {n_slices}, {max_rank}] with a contiguous last dim")


def lora_shrink(
    x: Tensor,
    A: Tensor,
    ranks: Tensor,
    xa: Tensor,
    *,
    token_slots: Tensor | None = None,
    segments: Segments | None = None,
    blocks: ShrinkBlocks | None = None,
) -> None:
    """xa[t, s, :rank] = x[t] · A[slot(t), s, :rank]ᵀ (fp32) for every token with a slot, in one launch.

    Exactly one of `token_slots` (gathered layout) or `segments` (segmented layout) is given. `blocks`: tile
    sizes and warps instead of `shrink_blocks`' (a tuning sweep's candidates).
    """
    _, n_slices, max_rank, in_dim = A.shape
    _check_rows("x", x, in_dim)
    _check_weights(A, ranks, 4)
    _check_xa(xa, x.shape[0], n_slices, max_rank)
    if A.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and A ({A.dtype}) must have the same dtype")
    check_device(x, A, ranks, xa)
    if x.shape[0] == 0:
        return
    strides = (x.stride(0), A.stride(0), A.stride(1), A.stride(2), xa.stride(0), xa.stride(1))
    if (token_slots is None) == (segments is None):
        raise ValueError("pass exactly one of token_slots (gathered) or segments (segmented)")
    if token_slots is not None:
        blk = blocks or shrink_blocks(in_dim=in_dim, max_seg_len=1, dtype=x.dtype, gathered=True)
        grid = (x.shape[0], triton.cdiv(max_rank, blk.BLOCK_R), n_slices)
        shrink_gathered_kernel[grid](
            x,
            A,
            xa,
            ranks,
            token_slots,
            in_dim,
            n_slices,
            *strides,
            BLOCK_R=blk.BLOCK_R,
            BLOCK_K=blk.BLOCK_K,
            num_warps=blk.num_warps,
        )
        return
    assert segments is not None
    if segments.num_segments == 0 or segments.max_seg_len == 0:
        return
    blk = blocks or shrink_blocks(in_dim=in_dim, max_seg_len=segments.max_seg_len, dtype=x.dtype, gathered=False)
    num_r_blocks = triton.cdiv(max_rank, blk.BLOCK_R)
    grid = (triton.cdiv(segments.max_seg_len, blk.BLOCK_M) * num_r_blocks, n_slices, segments.num_segments)
    shrink_segmented_kernel[grid](
        x,
        A,
        xa,
        ranks,
        segments.sorted_token_ids,
        segments.seg_indptr,
        segments.seg_slots,
        in_dim,
        n_slices,
        num_r_blocks,
        *strides,
        BLOCK_M=blk.BLOCK_M,
        BLOCK_R=blk.BLOCK_R,
        BLOCK_K=blk.BLOCK_K,
        num_warps=blk.num_warps,
        DOT_FP32=dot_operands_fp32(x.dtype),
        PRECISION=dot_precision(x.dtype),
    )


def lora_expand(
    xa: Tensor,
    B: Tensor,
    ranks: Tensor,
    scalings: Tensor,
    slice_offsets: Tensor,
    max_width: int,
    out: Tensor,
    *,
    token_slots: Tensor | None = None,
    segments: Segments | None = None,
    blocks: ExpandBlocks | None = None,
) -> None:
    """out[t, off_s:off_s+1] += scalings[slot, s] · xa[t, s, :rank] · B[slot, off_s:off_s+1, :rank]ᵀ, one launch.

    `slice_offsets` is an int32 device tensor [n_slices + 1]; `max_width` the widest slice (host int); `blocks`:
    tile sizes and warps instead of `expand_blocks`'.
    """
    _, out_total, max_rank = B.shape
    n_slices = slice_offsets.shape[0] - 1
    _check_rows("out", out, out_total)
    _check_weights(B, ranks, 3)
    _check_xa(xa, out.shape[0], n_slices, max_rank)
    if B.dtype != out.dtype:
        raise ValueError(f"out ({out.dtype}) and B ({B.dtype}) must have the same dtype")
    if scalings.dtype != torch.float32 or scalings.shape != ranks.shape or not scalings.is_contiguous():
        raise ValueError("scalings must be a contiguous float32 tensor shaped like ranks")
    check_device(xa, B, ranks, scalings, slice_offsets, out)
    if out.shape[0] == 0:
        return
    strides = (xa.stride(0), xa.stride(1), B.stride(0), B.stride(1), out.stride(0))
    if (token_slots is None) == (segments is None):
        raise ValueError("pass exactly one of token_slots (gathered) or segments (segmented)")
    if token_slots is not None:
        blk = blocks or expand_blocks(max_width=max_width, max_seg_len=1, dtype=out.dtype, gathered=True)
        grid = (out.shape[0], triton.cdiv(max_width, blk.BLOCK_N), n_slices)
        expand_gathered_kernel[grid](
            xa,
            B,
            out,
            ranks,
            scalings,
            slice_offsets,
            token_slots,
            n_slices,
            *strides,
            BLOCK_R=blk.BLOCK_R,
            BLOCK_N=blk.BLOCK_N,
            num_warps=blk.num_warps,
        )
        return
    assert segments is not None
    if segments.num_segments == 0 or segments.max_seg_len == 0:
        return
    blk = blocks or expand_blocks(
        max_width=max_width, max_seg_len=segments.max_seg_len, dtype=out.dtype, gathered=False
    )
    num_n_blocks = triton.cdiv(max_width, blk.BLOCK_N)
    grid = (triton.cdiv(segments.max_seg_len, blk.BLOCK_M) * num_n_blocks, n_slices, segments.num_segments)
    expand_segmented_kernel[grid](
        xa,
        B,
        out,
        ranks,
        scalings,
        slice_offsets,
        segments.sorted_token_ids,
        segments.seg_indptr,
        segments.seg_slots,
        n_slices,
        num_n_blocks,
        *strides,
        BLOCK_M=blk.BLOCK_M,
        BLOCK_R=blk.BLOCK_R,
        BLOCK_N=blk.BLOCK_N,
        num_warps=blk.num_warps,
        DOT_FP32=out.dtype == torch.float32 or dot_operands_fp32(out.dtype),
        PRECISION=dot_precision(out.dtype),
    )
