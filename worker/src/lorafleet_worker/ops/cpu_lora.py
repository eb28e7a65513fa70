"""The Python side of the grouped LoRA library (`csrc/lora.cpp`): the shrink and expand of every adapter of one
projection group in one C++ call (`lora_small`), each adapter at its own rank, the step's rows read and
updated in place, float32 and bfloat16 with float32 sums.

`available()` says whether the library serves this process (`loader`); without it the CPU LoRA backend runs
per-adapter torch matmuls. `LORAFLEET_CPU_LORA=torch` turns it off (read on every `available()` call, so when a
backend is created). `lora_small` and `kernel` assume the caller checked `available()`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lorafleet_worker.ops import loader

ENV = "LORAFLEET_CPU_LORA"

EXTENSION = loader.Extension(
    stem="lorafleet_cpu_lora",
    sources=("lora.cpp",),
    switch=ENV,
    what="CPU LoRA kernel",
    fallback="LoRA runs per-adapter torch matmuls",
)


def _module() -> Any:
    return loader.module(EXTENSION)


def available() -> bool:
    """True when the library serves this process: not switched off, and built (or buildable now)."""
    return loader.available(EXTENSION)


def lora_small(
    x: Tensor,
    out: Tensor,
    A: Tensor,
    B: Tensor,
    ranks: Tensor,
    scalings: Tensor,
    offsets: tuple[int, ...],
    rows: Tensor,
    segs: Tensor,
) -> None:
    """out[rows[p], slice s] += scalings[slot, s] · x[rows[p]] · A[slot, s, :r]ᵀ · B[slot, slice s, :r]ᵀ for each
    segment (slot, start, end) of `segs` (int64 [S, 3]), p in [start, end), slice s of rank r = ranks[slot, s] > 0.
    `ranks` / `scalings` are host tensors; x, out, A, B one dtype (float32 or bfloat16). The caller has
    checked `available()` (the backend does, once, when it picks this path): no switch is read per call."""
    mod = _module()
    mod.lora_small(x, out, A, B, ranks, scalings, list(offsets), rows, segs)


def kernel() -> Any:
    """The built op itself, `lora_small`'s arguments with `offsets` a list (for a caller that checked
    `available()` and calls it many times a step)."""
    mod = _module()
    return mod.lora_small


__all__ = ["ENV", "EXTENSION", "available", "kernel", "lora_small"]
