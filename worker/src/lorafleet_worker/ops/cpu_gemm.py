"""The Python side of the panel GEMM library (`csrc/gemm.cpp`): base-model linears with the weight in 16-wide
panels, one kernel for every batch size, float32, bfloat16 and int8 panels (`--quantization int8`,
`w8a8_int8`).

A weight [N, K] is stored as [ceil(N / 16), K, 16] (`pack`, a `PanelWeight`): for each group of 16 output
channels, the 16 weights of input k side by side. `linear` multiplies x by it (int8: times per-channel scales),
in x's dtype. `available()` says whether the library serves this process (`loader`); without it `cpu_linear`
keeps oneDNN or `F.linear`. `LORAFLEET_CPU_LINEAR=torch` turns it off with the rest of the packing. Measured
figures: bench/README.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lorafleet_worker.ops import loader

PANEL = 16  # output channels per panel (the C++ NR)

EXTENSION = loader.Extension(
    stem="lorafleet_cpu_gemm",
    sources=("gemm.cpp",),
    switch="LORAFLEET_CPU_LINEAR",
    what="CPU panel GEMM",
    fallback="base linears use oneDNN or F.linear",
)


def _module() -> Any:
    return loader.module(EXTENSION)


def available() -> bool:
    """True when the library serves this process: not switched off, and built (or buildable now)."""
    return loader.available(EXTENSION)


def kernel(w8a8: bool = False) -> Any:
    """The op itself: panel_linear(x [M, K], panels, out_features, scales or None, bias or None); `w8a8`: its
    8-bit-activation form for int8 panels (`has_w8a8`)."""
    mod = _module()
    return mod.panel_linear_w8a8 if w8a8 else mod.panel_linear


def has_w8a8() -> bool:
    """True when `kernel(w8a8=True)` rounds activations to 8 bits: the kernel built and this CPU has AVX512-VNNI
    (the path is compiled into every x86 build and taken only there)."""
    return available() and bool(_module().has_w8a8())


@dataclass(frozen=True)
class PanelWeight:
    """A [out_features, in_features] weight in panels (float32, bfloat16, or int8 with float32 `scales`)."""

    panels: Tensor  # [ceil(out / 16), in, 16]
    out_features: int
    scales: Tensor | None = None  # int8: per output channel, float32 [out]

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ w.T (+ bias) for x [..., in] in float32 or bfloat16; the result in x's dtype."""
        return linear(x, self.panels, self.out_features, self.scales, bias)

    @functools.cached_property
    def matmul_2d(self) -> Callable[[Tensor, Tensor | None], Tensor]:
        """`matmul` for a 2-D x, the op called directly (the decoder layer's projections: 121 calls a step)."""
        op = kernel()
        panels, n, scales = self.panels, self.out_features, self.scales

        def run(x: Tensor, bias: Tensor | None) -> Tensor:
            out: Tensor = op(x, panels, n, scales, bias)
            return out

        return run

    def to_dense(self) -> Tensor:
        """The weight [out, in] (int8: dequantized to float32)."""
        p, k, _ = self.panels.shape
        dense = self.panels.transpose(1, 2).reshape(p * PANEL, k)[: self.out_features]
        if self.scales is not None:
            return dense.float() * self.scales[:, None]
        return dense.contiguous()

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.panels.numel() * self.panels.element_size() + extra


def linear(
    x: Tensor, panels: Tensor, out_features: int, scales: Tensor | None, bias: Tensor | None, w8a8: bool = False
) -> Tensor:
    """x [..., in] @ the panels' weight.T (int8: times `scales` per output channel) + bias, in x's dtype; `w8a8`:
    int8 panels times x rounded to int8 per 32 inputs where the rows make it compute-bound (`kernel`)."""
    op = kernel(w8a8)
    if x.shape[-1] != panels.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {panels.shape[1]}")
    if x.dim() == 2:  # the engine's flat batch: no reshape calls (two torch ops per linear, 240 a decode step)
        flat: Tensor = op(x, panels, out_features, scales, bias)
        return flat
    out: Tensor = op(x.reshape(-1, panels.shape[1]), panels, out_features, scales, bias)
    return out.reshape(*x.shape[:-1], out_features)


def pack(w: Tensor, scales: Tensor | None = None) -> PanelWeight:
    """`w` [out, in] (float32, bfloat16; int8 with `scales`) in panels."""
    mod = _module()
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"panels hold 2-D float32, bfloat16 or int8 weights, not {w.dtype} {tuple(w.shape)}")
    if (w.dtype == torch.int8) != (scales is not None):
        raise ValueError("int8 panels need per-channel scales, and only int8 panels take them")
    panels: Tensor = mod.pack_panels(w.detach())
    return PanelWeight(panels, w.shape[0], None if scales is None else scales.float().contiguous())


__all__ = ["EXTENSION", "PANEL", "PanelWeight", "available", "has_w8a8", "kernel", "linear", "pack"]
