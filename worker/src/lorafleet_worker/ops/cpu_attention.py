"""The Python side of the CPU ops library (`csrc/attention.cpp`, `csrc/layer_ops.cpp`): paged decode
attention that reads each sequence's K/V blocks in place, a step's whole attention in one call (every row a
query over its paged context), the small ops of a decoder layer (RMSNorm, residual add + RMSNorm, SiLU x up,
RoPE in place) and greedy sampling's pick (`greedy_pick`).

`available()` says whether the library serves this process (`loader`: prebuilt, JIT-compiled, or none, then
the engine keeps the torch path); `LORAFLEET_CPU_ATTENTION=torch` turns it off. The op functions below assume
the caller checked `available()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from lorafleet_worker.ops import loader

if TYPE_CHECKING:
    from lorafleet_worker.model.forward_batch import ForwardBatch

EXTENSION = loader.Extension(
    stem="lorafleet_cpu_ops",
    sources=("attention.cpp", "layer_ops.cpp", "cpu_ops.cpp"),
    switch="LORAFLEET_CPU_ATTENTION",
    what="CPU C++ ops",
    fallback="decode attention and small ops use torch",
)


def _module() -> Any:
    return loader.module(EXTENSION)


def available() -> bool:
    """True when the library serves this process: not switched off, and built (or buildable now)."""
    return loader.available(EXTENSION)


def native() -> Any:
    """The compiled module itself (`available()` first): its functions take the arguments the wrappers below
    pass, without a wrapper's call (a decode step's hot loop, `transformer._cpu_decode`)."""
    return _module()


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None,
) -> Tensor:
    """Attention of one query per sequence (q [B, H, D]) over its blocks; `window`: sliding window or None."""
    mod = _module()
    out: Tensor = mod.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, float(scale), int(window or 0))
    return out


def decode_attention(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: ForwardBatch,
    num_heads: int,
    scale: float,
    window: int | None,
) -> Tensor:
    """A step's attention from the qkv projection [T, (H + 2 KVH) D] where every row is a query over its paged
    context (`batch.query_tables`: decode tokens, verified drafts, prompt rows), one op: per-head q/k RMSNorm
    (when given), RoPE on q and k in place, k/v into the caches at `batch.slot_mapping`, paged decode.
    Returns [T, H * D]; the same arithmetic as `rope_`, the cache writes and `paged_decode`."""
    mod = _module()
    tables, lens = batch.query_tables()
    out: Tensor = mod.decode_attention(
        qkv, cos, sin, q_norm, k_norm, float(eps), k_cache, v_cache, batch.slot_mapping,
        tables, lens, int(num_heads), float(scale), int(window or 0),
    )  # fmt: skip
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of the rows of x [T, dim] (Hugging Face's rounding), one op."""
    mod = _module()
    out: Tensor = mod.rms_norm(x, weight, float(eps))
    return out


def add_rms_norm_(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor:
    """h += delta in place, then the RMSNorm of h, one op."""
    mod = _module()
    out: Tensor = mod.add_rms_norm_(h, delta, weight, float(eps))
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I], one op."""
    mod = _module()
    out: Tensor = mod.silu_mul(gate_up)
    return out


def greedy_pick(logits: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row's greedy token (the first max, as `argmax`) and its log-probability (`log_softmax` there) for
    float32 logits [N, V], two passes a row; None where a row holds a NaN or an infinity (use torch)."""
    mod = _module()
    tokens, logprobs = mod.greedy_pick(logits)
    return None if tokens.numel() != logits.shape[0] else (tokens, logprobs)


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate x [T, heads, D] in place (rotate-half RoPE; cos/sin [T, D] or [T, 1, D] in x's dtype)."""
    mod = _module()
    mod.rope_(x, cos, sin)


__all__ = [
    "EXTENSION",
    "add_rms_norm_",
    "available",
    "decode_attention",
    "greedy_pick",
    "native",
    "paged_decode",
    "rms_norm",
    "rope_",
    "silu_mul",
]
