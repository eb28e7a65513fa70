"""Attention over the paged KV cache for one layer of the flat batch, with three decode backends.

The step's K/V are written into the layer's cache first. With the `"cpu"` backend every row of the step, prefill
rows too, then attends through the C++ paged kernel in one call: a prompt token at position p is a query over
the cached tokens 0..p (`ForwardBatch.row_block_tables`); on CPU it is faster than SDPA at every prompt length
(bench/README.md has the figures). Otherwise prefill chunks attend with
torch SDPA (a fresh prompt over its own K/V, a later chunk over its cached context). Decode tokens attend with
the `"torch"` backend (gather each sequence's blocks, masked SDPA), the `"cpu"` C++ loop that reads the blocks
in place (`cpu_attention.py`) or the `"triton"` paged-attention kernel (`kernels/paged_attention.py`, no
sliding window).

Shapes: q [T, H, D], k/v [T, KVH, D]; caches [num_blocks, block_size, KVH, D] (`kv_cache.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafleet_worker.model.forward_batch import ForwardBatch
from lorafleet_worker.ops import cpu_attention


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: ForwardBatch,
    scale: float,
    backend: str,
    window: int | None = None,
) -> Tensor:
    """Store k/v at `batch.slot_mapping`, then attend: decode rows first, then each prefill chunk."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    tables, lens = batch.row_block_tables, batch.row_seq_lens
    if backend == "cpu" and tables is not None and lens is not None:  # every row, prefill too, in one call
        return cpu_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, window)
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        if backend == "cpu":
            out[:nd] = cpu_attention.paged_decode(
                q[:nd], k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, scale, window
            )
        else:
            decode = _triton_decode if backend == "triton" else _torch_decode
            out[:nd] = decode(q[:nd], k_cache, v_cache, batch, scale)
    for p in batch.prefills:
        sl = slice(p.start, p.start + p.num_tokens)
        if p.context_len == p.num_tokens:  # fresh prompt: attend to the chunk's own k/v
            ks, vs = k[sl], v[sl]
        else:
            ks = k_cache[p.block_ids].flatten(0, 1)[: p.context_len]
            vs = v_cache[p.block_ids].flatten(0, 1)[: p.context_len]
        out[sl] = _prefill(q[sl], ks, vs, p.mask, scale)
    return out


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    # q [B, H, Lq, D], k/v [B, KVH, Lk, D]
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_kv_heads != num_heads
    if gqa and q.device.type == "cuda":  # native GQA in the fused kernels
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    if gqa:  # faster than enable_gqa on CPU
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _prefill(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Causal attention of a chunk (q [n, H, D]) over its context k/v [prior + n, KVH, D].

    `mask` is None for a chunk without prior context (plain causal attention).
    """
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    return _sdpa(qh, kh, vh, mask, mask is None, scale)[0].transpose(0, 1)


def _torch_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch, scale: float) -> Tensor:
    """One query per sequence (q [B, H, D]) over each sequence's paged context, masked by `batch.decode_mask`."""
    bt = batch.decode_block_tables
    b, max_blocks = bt.shape
    _, bs, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    ks = k_cache[bt].view(b, max_blocks * bs, num_kv_heads, head_dim).transpose(1, 2)
    vs = v_cache[bt].view(b, max_blocks * bs, num_kv_heads, head_dim).transpose(1, 2)
    # GQA without copying K/V: the query heads of one KV head become that head's query rows
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=batch.decode_mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)


def _triton_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch, scale: float) -> Tensor:
    """One query per sequence through the Triton paged-attention kernel (imported only when used)."""
    from lorafleet_worker.kernels.paged_attention import paged_attention_decode

    return paged_attention_decode(q, k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, scale)
