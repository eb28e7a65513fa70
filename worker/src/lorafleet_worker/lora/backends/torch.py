"""`TorchLoRABackend`: per-adapter torch matmuls on any device (on CUDA the reference of the Triton kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..batch import LoRABatchInfo, build_batch_info
from ..weights import LoRAProjWeights
from .base import StepRunner

if TYPE_CHECKING:
    from ..pool import LoRAPool

Segment = tuple[int, int, int, int]  # (slot, start, end) into sorted_token_ids, first row of its tokens or -1


class TorchLoRABackend:
    """Multi-LoRA with one shrink mm and one in-place addmm_ per (adapter, slice) and projection group.

    An adapter's tokens that are consecutive rows (a prefill chunk, decodes the scheduler placed side by side)
    are read and updated in place; the others are gathered once and added back with one index_add_.
    `CpuLoRABackend` (cpu.py) sends the short segments to a grouped C++ kernel instead.
    """

    grouped = "torch"  # how the short segments run (cpu.py: "cpp")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, token_slots: Tensor) -> LoRABatchInfo:
        return build_batch_info(token_slots)

    def step_runner(self, pool: LoRAPool, batch: LoRABatchInfo) -> StepRunner | None:
        return None

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        if not batch.has_lora:
            return
        adapted = w.slot_adapted
        if adapted is not None and not any(adapted[slot] for slot, _, _ in batch.segments):
            return  # no adapter of the step adapts this group (e.g. q/v-only adapters on the MLP)
        segments = tuple((s, a, b, row) for (s, a, b), row in zip(batch.segments, batch.segment_rows, strict=True))
        self._per_adapter(x, out, w, batch, segments)

    def _per_adapter(
        self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo, segments: tuple[Segment, ...]
    ) -> None:
        """Per-adapter matmuls: a segment of consecutive rows is read and updated in place; the others
        (decodes of one adapter spread over the batch) are gathered once into one buffer, updated there,
        and scattered back with one index_add_."""
        ranks, scalings = w.host_meta()
        in_place = out.dtype == x.dtype
        scattered: list[tuple[int, int, int]] = []
        for slot, start, end, row in segments:
            if row >= 0 and in_place:
                n = end - start
                self._segment(x[row : row + n], out[row : row + n], w, slot, ranks[slot], scalings[slot])
            else:
                scattered.append((slot, start, end))
        if not scattered:
            return
        ids = batch.sorted_token_ids
        order = torch.cat([ids[start:end] for _, start, end in scattered]).long()
        xs = x.index_select(0, order)
        delta = x.new_zeros(xs.shape[0], out.shape[1])
        lo = 0
        for slot, start, end in scattered:
            hi = lo + end - start
            self._segment(xs[lo:hi], delta[lo:hi], w, slot, ranks[slot], scalings[slot])
            lo = hi
        out.index_add_(0, order, delta.to(out.dtype))

    @staticmethod
    def _segment(
        x: Tensor, out: Tensor, w: LoRAProjWeights, slot: int, ranks: list[int], scalings: list[float]
    ) -> None:
        """out += every slice's scaling * (x @ A_sᵀ) @ B_sᵀ for one adapter: per slice one mm and one
        in-place addmm_ (scaling as its alpha) into a strided view of `out`: no temporaries."""
        offs = w.slice_offsets
        a_slot, b_slot = _as(w.A[slot], x.dtype), _as(w.B[slot], x.dtype)
        for s, (r, scaling) in enumerate(zip(ranks, scalings, strict=True)):
            if r:
                shrunk = torch.mm(x, a_slot[s, :r].t())
                out[:, offs[s] : offs[s + 1]].addmm_(shrunk, b_slot[offs[s] : offs[s + 1], :r].t(), alpha=scaling)


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype` (no call at all when it already is: this runs thousands of times a step)."""
    return t if t.dtype == dtype else t.to(dtype)
