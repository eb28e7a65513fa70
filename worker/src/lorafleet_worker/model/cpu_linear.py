"""Base-model linears on CPU with the weights prepacked once: 16-wide panels for our own kernel
(`cpu_gemm.py`), or oneDNN's blocked layout (the way inductor's freezing does).

`F.linear` on CPU hands a float32 GEMM to MKL, which repacks the weight on every call; at decode
shapes (M = the number of running sequences) that repacking and the plain weight layout cost as much
as the multiply. oneDNN with its weight reordered once at load (`mkldnn._reorder_linear_weight`, a
blocked layout for this CPU's ISA) and called through `mkldnn._linear_pointwise` measured, on a
2-core AVX512-BF16 EPYC, 768 x 4608 projection: float32 1.8x faster at M = 32
(3x at M = 8, 1.15x at M = 2048), bfloat16 1.5x at M = 32; the 14 layers of the 97M bench model at
M = 32: 67.5 -> 33.0 ms float32, 27.6 -> 18.0 ms bfloat16.

`mode(dtype)` picks one layout per weight (keeping both would double the weights' memory):
- `panel` on CPUs without AVX-512: measured there as fast as oneDNN from M = 128 up and faster below
  (1.1-1.4x at M = 1-32, float32), and the only fast bfloat16 path where oneDNN has no bfloat16 kernel;
- `onednn` on AVX-512 CPUs, whose oneDNN kernels use the 512-bit units (and AMX / AVX512-BF16 for bfloat16)
  that the panel kernel does not;
- `torch` (`F.linear`) where neither can serve the dtype.
`LORAFLEET_CPU_LINEAR` = `panel`, `onednn` or `torch` overrides the choice (`torch` turns packing off).

`pack(w)` returns the packed weight, or None where the chosen path cannot serve it (no mkldnn in this torch
build, another device or dtype, or the probe call fails): the caller then keeps `F.linear`. `linear` also
serves a weight quantized by `--quantization` (`quantization.py`, CPU or CUDA) in place of the packed one.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafleet_worker import native_ops
from lorafleet_worker.model import cpu_gemm
from lorafleet_worker.model.cpu_gemm import PanelWeight
from lorafleet_worker.model.quantization import QuantizedWeight

log = logging.getLogger(__name__)

ENV = "LORAFLEET_CPU_LINEAR"
MODES = ("panel", "onednn", "torch")
Packed = Tensor | PanelWeight | QuantizedWeight  # what `linear` reads in place of the dense weight


def enabled() -> bool:
    """Packing is on unless LORAFLEET_CPU_LINEAR=torch."""
    return os.environ.get(ENV, "").lower() != "torch"


def _onednn_serves(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def mode(dtype: torch.dtype) -> str:
    """The base-linear path for CPU weights of `dtype`: one of MODES (see the module docstring)."""
    asked = os.environ.get(ENV, "").lower()
    if asked == "torch" or dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    onednn = _onednn_serves(dtype)
    if asked == "onednn":
        return "onednn" if onednn else "torch"
    wants_panel = asked == "panel" or not (onednn and "avx512f" in native_ops.cpu_flags())
    if wants_panel and cpu_gemm.available():
        return "panel"
    return "onednn" if onednn else "torch"


def packs(dtype: torch.dtype) -> bool:
    """Whether CPU weights of `dtype` will be packed (the probe call aside)."""
    return mode(dtype) != "torch"


def pack(w: Tensor) -> Tensor | PanelWeight | None:
    """`w` [out, in] in panels or reordered for oneDNN's linear, or None where `F.linear` has to stay."""
    if w.device.type != "cpu" or w.dim() != 2:
        return None
    chosen = mode(w.dtype)
    if chosen == "panel":
        return cpu_gemm.pack(w)
    if chosen == "torch":
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


def linear(x: Tensor, w: Tensor, b: Tensor | None, packed: Packed | None) -> Tensor:
    """x @ w.T + b, through the packed (or quantized) weight when there is one."""
    if packed is None:
        return F.linear(x, w, b)
    if isinstance(packed, PanelWeight):
        return packed.matmul(x, b)
    if isinstance(packed, QuantizedWeight):
        y = packed.matmul(x)
        return y if b is None else y + b
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return out


__all__ = ["ENV", "MODES", "Packed", "enabled", "linear", "mode", "pack", "packs"]
