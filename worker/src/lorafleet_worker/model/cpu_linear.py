"""Base-model linears on CPU with the weights prepacked once for oneDNN (the way inductor's freezing does).

`F.linear` on CPU hands a float32 GEMM to MKL, which repacks the weight on every call; at decode
shapes (M = the number of running sequences) that repacking and the plain weight layout cost as much
as the multiply. oneDNN with its weight reordered once at load (`mkldnn._reorder_linear_weight`, a
blocked layout for this CPU's ISA) and called through `mkldnn._linear_pointwise` measured, on the
2-core AVX512-BF16 EPYC of the benchmarks, 768 x 4608 projection: float32 1.8x faster at M = 32
(3x at M = 8, 1.15x at M = 2048), bfloat16 1.5x at M = 32; the 14 layers of the 97M bench model at
M = 32: 67.5 -> 33.0 ms float32, 27.6 -> 18.0 ms bfloat16.

`pack(w)` returns the packed weight, or None where oneDNN cannot serve it (no mkldnn in this torch
build, another device or dtype, bf16 without hardware support, or the probe call fails): the caller
then keeps `F.linear`. `LORAFLEET_CPU_LINEAR=torch` turns packing off. `linear` also serves a weight
quantized by `--quantization` (`quantization.py`, CPU or CUDA) in place of the packed one.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafleet_worker.model.quantization import QuantizedWeight

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Packing is on unless LORAFLEET_CPU_LINEAR=torch, and this torch build has oneDNN."""
    if os.environ.get("LORAFLEET_CPU_LINEAR", "").lower() == "torch":
        return False
    return bool(torch.backends.mkldnn.is_available())


def packs(dtype: torch.dtype) -> bool:
    """Whether CPU weights of `dtype` will be packed (the probe call aside)."""
    if not enabled():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(w: Tensor) -> Tensor | None:
    """`w` [out, in] reordered for oneDNN's linear, or None where `F.linear` has to stay."""
    if w.device.type != "cpu" or w.dim() != 2 or not packs(w.dtype):
        return None
    try:
        packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
        probe = torch.ones(2, w.shape[1], dtype=w.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if got.shape != (2, w.shape[0]) or not torch.allclose(got.float(), F.linear(probe, w).float(), 1e-2, 1e-2):
            raise RuntimeError("the packed weight's probe disagrees with F.linear")
    except Exception as exc:  # an op missing or failing in this build: the plain path still works
        log.warning("oneDNN prepacked linear unavailable (%s); base GEMMs use F.linear", exc)
        return None
    return packed


def linear(x: Tensor, w: Tensor, b: Tensor | None, packed: Tensor | QuantizedWeight | None) -> Tensor:
    """x @ w.T + b, through the packed (or quantized) weight when there is one."""
    if packed is None:
        return F.linear(x, w, b)
    if isinstance(packed, QuantizedWeight):
        y = packed.matmul(x)
        return y if b is None else y + b
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return out


__all__ = ["enabled", "linear", "pack", "packs"]
