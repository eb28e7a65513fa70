"""Triton kernels of the worker's GPU path (multi-LoRA shrink/expand, paged-attention decode).

On a machine without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU
tensors; that is how the tests check them against the torch references.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`), read at call time."""
    return bool(triton.knobs.runtime.interpret)


class LazyKernel:
    """A Triton kernel jitted at its first launch, once per mode (compiled / interpreted).

    `triton.jit` reads `TRITON_INTERPRET` when it decorates, so a plain `@triton.jit` at import time would fix
    the mode for the whole process; deferring it lets the interpreter be switched on after triton and this
    package were imported (as the kernel tests do). Launch like a jitted kernel: `kernel[grid](*args, **meta)`.

    Triton's own jitted helpers (`tl.zeros`, `tl.sum`, `tl.max`, ...) are fixed to one mode when triton is
    imported, so the kernels use only builtins: `tl.full` for zeros and `tl.reduce` with the standard
    combine functions (`tl.standard._sum_combine`, `_elementwise_max`), which the interpreter recognises.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        mode = interpreting()
        kernel = self._jitted.get(mode)
        if kernel is None:
            kernel = self._jitted[mode] = triton.jit(self.fn)
        return kernel[grid]


def dot_operands_fp32(dtype: torch.dtype) -> bool:
    """Whether `tl.dot` operands must be upcast to fp32 first.

    Triton's interpreter stores bfloat16 as raw uint16 and multiplies the bit patterns in `tl.dot`
    (triton-lang/triton#11584, not supported upstream), so under the interpreter bf16 tiles are upcast.
    Compiled kernels keep bf16 tiles (tensor cores); accumulation is fp32 in both cases.
    """
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 products for fp32 inputs (no TF32 rounding), default otherwise."""
    return "ieee" if dtype == torch.float32 or dot_operands_fp32(dtype) else "tf32"


def check_device(*tensors: torch.Tensor) -> None:
    """Kernel tensors must share one device: CUDA, or CPU under the interpreter."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all kernel tensors must be on one device, got {t.device} and {device}")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run on CPU")
