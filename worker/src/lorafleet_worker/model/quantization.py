"""Quantized base linears (`--quantization int8|int4|w8a8_int8`): the panel kernel and PyTorch's packed matmuls.

`int8`: one symmetric scale per output channel (`scale = max|w| / 127`): a quarter of float32's bytes, half
of bfloat16's. On CUDA it is served by `aten._weight_int8pack_mm`; on CPU by the panel kernel
(`cpu_gemm.py`, int8 panels widened in registers, the scale applied per output channel), because PyTorch's
CPU int8-pack kernel, a row-at-a-time loop that converts each weight again for every row of x, measured
8x slower than the panel kernel's int8 at one row and 3x slower than float32 (the 121 linears of
SmolLM2-135M on the 2-core AVX2 EPYC: 266 vs 33 ms at M = 1); it stays the CPU path where the panel kernel
cannot be built.
`int4`: asymmetric groups of 32 input channels, scale and zero per group
(`w = (q - 8) * scale + zero`, the tinygemm layout), served by `aten._weight_int4pack_mm_for_cpu` on
CPU and `aten._weight_int4pack_mm` on CUDA (bfloat16 activations there).
`w8a8_int8` (CPU with AVX512-VNNI; SGLang's name for int8 weights and activations): the int8 weights above, and
where more than one tile of rows makes the GEMM compute-bound (prefill, batched decode) each row of x is rounded
to int8 per 32 inputs with its own scale, as llama.cpp's Q8_0 does, and multiplied in bytes (`vpdpbusd`,
`cpu_gemm.py`): ~2x the int8 kernel's rate there, for an output error of ~0.7-0.9 % of a real layer's (as large
as the int8 weights' own; bfloat16's rounding is 0.17 %). One row (a single user's decode, memory-bound) keeps
x as it is. Only int8 and int4 are weight-only.
Activations stay in the model's dtype and LoRA is applied on top in full precision (`DecoderLayer._proj`);
embeddings and norms are not quantized, the lm_head is. `QuantizedWeight.to_dense()` gives back the
dequantized weight, which is what the tests compare with transformers + PEFT.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lorafleet_worker.ops import cpu_gemm

METHODS = ("int8", "int4", "w8a8_int8")
INT8_METHODS = ("int8", "w8a8_int8")  # the same int8 weights per output channel
INT4_GROUP = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out, in] weight quantized for one of METHODS, with the matmul that reads it."""

    method: str
    qweight: Tensor  # int8 [out, in], or in panels (`cpu_gemm.py`); int4: packed for this device's kernel
    scales: Tensor  # int8: [out] in the activation dtype (float32 with panels); int4: [in / group, out, 2]
    shape: tuple[int, int]
    dtype: torch.dtype  # the activations' (and the dense weight's) dtype
    panels: bool = False  # int8 in the panel kernel's layout (CPU)

    @functools.cached_property
    def matmul_2d(self) -> Callable[[Tensor, Tensor | None], Tensor] | None:
        """x @ w.T (+ bias, added in x's dtype as `cpu_linear.linear` adds it) for a 2-D x, the panel op called
        directly; None where the weight is not in panels."""
        if not self.panels:
            return None
        op = cpu_gemm.kernel(w8a8=self.method == "w8a8_int8")
        qweight, n, scales = self.qweight, self.shape[0], self.scales

        def run(x: Tensor, bias: Tensor | None) -> Tensor:
            out: Tensor = op(x, qweight, n, scales, None)
            return out if bias is None else out + bias

        return run

    def matmul(self, x: Tensor) -> Tensor:
        """x @ w.T for x [..., in] of `dtype`."""
        if self.panels:
            return cpu_gemm.linear(x, self.qweight, self.shape[0], self.scales, None, self.method == "w8a8_int8")
        flat = x.reshape(-1, self.shape[1])
        if self.method == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        elif flat.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, INT4_GROUP, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm(flat, self.qweight, INT4_GROUP, self.scales)
        result: Tensor = out.reshape(*x.shape[:-1], self.shape[0])
        return result

    def to_dense(self) -> Tensor:
        """The dequantized weight [out, in] in `dtype` (what the matmul multiplies by, up to rounding)."""
        eye = torch.eye(self.shape[1], dtype=self.dtype, device=self.qweight.device)
        return self.matmul(eye).T.contiguous()

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(w: Tensor, method: str) -> QuantizedWeight:
    """Quantize a dense [out, in] weight (float32 / bfloat16 / float16) for `method`."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if w.dim() != 2:
        raise ValueError(f"only 2-D weights are quantized, got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    w32 = w.detach().float()
    if method in INT8_METHODS:
        scale = (w32.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
        if w.device.type == "cpu" and cpu_gemm.available():
            panels = cpu_gemm.pack(q, scale).panels
            return QuantizedWeight(method, panels, scale.contiguous(), (out_dim, in_dim), w.dtype, panels=True)
        if method == "w8a8_int8":
            raise ValueError("w8a8_int8 needs the CPU panel kernel (cpu_gemm.py)")
        return QuantizedWeight("int8", q.contiguous(), scale.to(w.dtype), (out_dim, in_dim), w.dtype)
    if in_dim % INT4_GROUP:
        raise ValueError(f"int4 needs the input dimension ({in_dim}) to be a multiple of {INT4_GROUP}")
    groups = w32.reshape(out_dim, in_dim // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo) / scale).clamp(0, 15).reshape(out_dim, in_dim).to(torch.int32)
    zero = lo + 8 * scale
    dtype = w.dtype if w.device.type == "cpu" else torch.bfloat16
    scales = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [in / group, out, 2]
    tiles = next(t for t in (8, 4, 2, 1) if in_dim % (16 * t) == 0)  # CUDA's tiling of K (the CPU ignores it)
    if w.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
    else:  # two nibbles a byte, even columns high (PyTorch's test__int4_mm)
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles)
    return QuantizedWeight("int4", packed, scales, (out_dim, in_dim), dtype)


def quantized_nbytes(out_dim: int, in_dim: int, method: str, dtype: torch.dtype) -> int:
    """Bytes `quantize` gives for an [out_dim, in_dim] weight (what the memory plan counts, memory.py)."""
    if method in INT8_METHODS:
        return out_dim * in_dim + out_dim * dtype.itemsize
    return out_dim * in_dim // 2 + (in_dim // INT4_GROUP) * out_dim * 2 * dtype.itemsize


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError naming what does not fit: the method, or int4 on CUDA with non-bf16 activations."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError("--quantization int4 on CUDA needs --dtype bfloat16 (the tinygemm kernel's)")
    if method == "w8a8_int8" and (device.type != "cpu" or not cpu_gemm.has_w8a8()):
        where = "a CUDA device" if device.type != "cpu" else "this CPU (no AVX512-VNNI, or no panel kernel)"
        raise ValueError(f"--quantization w8a8_int8 runs on CPUs with AVX512-VNNI, not on {where}; use int8")


__all__ = [
    "INT4_GROUP",
    "INT8_METHODS",
    "METHODS",
    "QuantizedWeight",
    "check_supported",
    "quantize",
    "quantized_nbytes",
]
