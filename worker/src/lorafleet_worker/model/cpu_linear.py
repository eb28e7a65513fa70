"""Base-model linears on CPU with the weights prepacked once: 16-wide panels for our own kernel
(`ops/cpu_gemm.py`), oneDNN's blocked layout (reordered once at load, as inductor's freezing does), or both.

`F.linear` on CPU hands a float32 GEMM to MKL, which repacks the weight on every call; at decode shapes that
repacking costs as much as the multiply. `mode(dtype)` picks the layout of every weight:
- `panel` on CPUs without AVX-512 (as fast as oneDNN from 128 rows up, faster below, and the only fast bfloat16
  path where oneDNN has none);
- `split` on AVX-512 CPUs: each weight in both layouts (`SplitWeight`, twice the linears' memory), panels for
  up to PANEL_MAX_ROWS rows and oneDNN above, so one user's decode and a prefill each get the faster kernel;
- `onednn` where the panel kernel did not build (or asked for);
- `torch` (`F.linear`) where neither can serve the dtype.
`LORAFLEET_CPU_LINEAR` = `panel`, `split`, `onednn` or `torch` overrides the choice (`torch` turns packing off;
`panel` or `onednn` keeps one layout, half the memory of `split`). Measured figures: bench/README.md.

`pack(w)` returns the packed weight, or None where the chosen path cannot serve it (no mkldnn in this torch
build, another device or dtype, or the probe call fails): the caller then keeps `F.linear`. `linear` also
serves a weight quantized by `--quantization` (`quantization.py`, CPU or CUDA) in place of the packed one.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafleet_worker.model.quantization import QuantizedWeight
from lorafleet_worker.ops import cpu_gemm, loader
from lorafleet_worker.ops.cpu_gemm import PanelWeight

log = logging.getLogger(__name__)

ENV = "LORAFLEET_CPU_LINEAR"
MODES = ("panel", "split", "onednn", "torch")
PANEL_MAX_ROWS = 4  # `split`: panels up to this many rows of x, oneDNN above (the measured crossover)


def _onednn_linear(x: Tensor, packed: Tensor, b: Tensor | None) -> Tensor:
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return out


@dataclass(frozen=True)
class SplitWeight:
    """One weight in both layouts (`split` mode): the panel kernel for up to PANEL_MAX_ROWS rows of x, oneDNN's
    blocked layout for more. `to_dense` reads the panels."""

    panel: PanelWeight
    onednn: Tensor

    def matmul(self, x: Tensor, b: Tensor | None = None) -> Tensor:
        if x.numel() <= PANEL_MAX_ROWS * x.shape[-1]:
            return self.panel.matmul(x, b)
        return _onednn_linear(x, self.onednn, b)

    @functools.cached_property
    def matmul_2d(self) -> Callable[[Tensor, Tensor | None], Tensor]:
        """`matmul` for a 2-D x (the decoder layer's direct call)."""
        panel, onednn = self.panel.matmul_2d, self.onednn

        def run(x: Tensor, b: Tensor | None) -> Tensor:
            return panel(x, b) if x.shape[0] <= PANEL_MAX_ROWS else _onednn_linear(x, onednn, b)

        return run

    def to_dense(self) -> Tensor:
        return self.panel.to_dense()

    @property
    def nbytes(self) -> int:
        return self.panel.nbytes + self.onednn.numel() * self.onednn.element_size()


Packed = Tensor | PanelWeight | SplitWeight | QuantizedWeight  # what `linear` reads in place of the dense weight


def panel_tensor(p: Packed | None) -> Tensor | None:
    """The panel tensor a weight's decode reads (float32, bfloat16 or int8 panels), None where it has none."""
    if isinstance(p, SplitWeight):
        return p.panel.panels
    if isinstance(p, PanelWeight):
        return p.panels
    if isinstance(p, QuantizedWeight) and p.panels:
        return p.qweight
    return None  # oneDNN's opaque tensors, dense weights, int4


class PanelArena:
    """One buffer for the panels of every base weight, filled in the order a decode step reads them (`move`).

    One user's decode streams every panel once a step, so it runs at the memory's read speed, and that needs
    2 MB pages (`huge_pages.py`): PyTorch gives them only to allocations of 2 MB or more, and most of a small
    model's panels are smaller (SmolLM2-135M in bfloat16: qkv 1.1 MB, o 0.7 MB, down 1.8 MB a layer). Packed
    weight by weight they sat on 4 KB pages; gathered here, the step reads one 2 MB-paged stream, layer after
    layer.
    """

    ALIGN = 64  # bytes: every panel tensor starts on a cache line

    def __init__(self, weights: Iterable[Packed | None]) -> None:
        sizes = [t.nbytes for t in map(panel_tensor, weights) if t is not None]
        self.buffer = torch.empty(sum(-(-n // self.ALIGN) * self.ALIGN for n in sizes), dtype=torch.uint8)
        self.used = 0

    def move(self, p: Packed) -> Packed:
        """`p` with its panels copied into the next free bytes of the arena (the same weight, the same bits)."""
        src = panel_tensor(p)
        if src is None:
            return p
        end = self.used + src.nbytes
        if end > self.buffer.numel():
            raise ValueError("the arena was sized for other weights")
        dst = self.buffer[self.used : end].view(src.dtype).view(src.shape).copy_(src)
        self.used = -(-end // self.ALIGN) * self.ALIGN
        if isinstance(p, SplitWeight):
            return SplitWeight(replace(p.panel, panels=dst), p.onednn)
        if isinstance(p, PanelWeight):
            return replace(p, panels=dst)
        assert isinstance(p, QuantizedWeight)
        return replace(p, qweight=dst)


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
    if cpu_gemm.available():
        if asked == "panel" or not onednn:
            return "panel"
        return "split" if asked == "split" or "avx512f" in loader.cpu_flags() else "panel"
    return "onednn" if onednn else "torch"


def layouts(dtype: torch.dtype) -> int:
    """How many packed copies each CPU weight of `dtype` has (2 in `split` mode), for the memory plan."""
    return 2 if mode(dtype) == "split" else 1


def packs(dtype: torch.dtype) -> bool:
    """Whether CPU weights of `dtype` will be packed (the probe call aside)."""
    return mode(dtype) != "torch"


def pack(w: Tensor) -> Tensor | PanelWeight | SplitWeight | None:
    """`w` [out, in] in panels, reordered for oneDNN's linear or both, or None where `F.linear` has to stay."""
    if w.device.type != "cpu" or w.dim() != 2:
        return None
    chosen = mode(w.dtype)
    if chosen == "panel":
        return cpu_gemm.pack(w)
    if chosen == "torch":
        return None
    onednn = _onednn_pack(w)
    if chosen == "split":
        panel = cpu_gemm.pack(w)
        return panel if onednn is None else SplitWeight(panel, onednn)
    return onednn


def _onednn_pack(w: Tensor) -> Tensor | None:
    """`w` reordered for oneDNN's linear and checked by one probe call; None where that fails."""
    try:
        packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
        probe = torch.ones(2, w.shape[1], dtype=w.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if got.shape != (2, w.shape[0]) or not torch.allclose(got.float(), F.linear(probe, w).float(), 1e-2, 1e-2):
            raise RuntimeError("the packed weight's probe disagrees with F.linear")
    except Exception as exc:  # an op missing or failing in this build: the plain path still works
        log.warning("oneDNN prepacked linear unavailable (%s); base GEMMs use panels or F.linear", exc)
        return None
    return packed


def linear(x: Tensor, w: Tensor, b: Tensor | None, packed: Packed | None) -> Tensor:
    """x @ w.T + b, through the packed (or quantized) weight when there is one."""
    if packed is None:
        return F.linear(x, w, b)
    if isinstance(packed, PanelWeight | SplitWeight):
        return packed.matmul(x, b)
    if isinstance(packed, QuantizedWeight):
        y = packed.matmul(x)
        return y if b is None else y + b
    return _onednn_linear(x, packed, b)


__all__ = [
    "ENV", "MODES", "PANEL_MAX_ROWS", "Packed", "PanelArena", "SplitWeight", "enabled", "layouts", "linear", "mode",
    "pack", "packs", "panel_tensor",
]  # fmt: skip
