"""Rotary position embeddings: inverse frequencies of the RoPE variants (default, linear, llama3, yarn)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lorafleet_worker.config import ModelConfig, ModelConfigError


def rope_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") for the config's RoPE type."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_ff, high_ff = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high_ff) & ~(wavelen > old_len / low_ff)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, factor, scaling, config.max_position_embeddings)
    raise ModelConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(dim: int, base: float, factor: float, scaling: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    orig = float(scaling.get("original_max_position_embeddings") or max_pos / factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(attn)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos / sin tables [T, 1, head_dim] of `positions`, computed in float32 and cast to `dtype`."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scale).to(dtype)
    sin = (emb.sin() * scale).to(dtype)
    return cos[:, None, :], sin[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [T, heads, head_dim] by the tables of `rope_cos_sin` (Hugging Face's rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
