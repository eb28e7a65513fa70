"""The LoRA seam between the model and the slot pool: weights views, backend protocol, torch backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .batch import LoRABatchInfo, build_batch_info

BACKENDS = ("torch", "triton")


@dataclass
class LoRAProjWeights:
    """Views into the slot pool for one (layer, projection group).

    Slice s of the group's output is rows `slice_offsets[s]:slice_offsets[s+1]` of B.
    `ranks_cpu` / `scalings_cpu` mirror `ranks` / `scalings` on the host (kept in sync by
    the pool) so host-side loops need no device sync; None means "read the device tensors".
    """

    A: Tensor  # [num_slots, n_slices, max_rank, in_dim]
    B: Tensor  # [num_slots, out_total, max_rank]
    ranks: Tensor  # int32 [num_slots, n_slices] (0 = module not adapted)
    scalings: Tensor  # float32 [num_slots, n_slices]
    slice_offsets: tuple[int, ...]  # len n_slices + 1, offsets into out_total
    ranks_cpu: Tensor | None = None
    scalings_cpu: Tensor | None = None

    @property
    def n_slices(self) -> int:
        return len(self.slice_offsets) - 1

    def host_meta(self) -> tuple[list[list[int]], list[list[float]]]:
        """(ranks, scalings) as host lists indexed [slot][slice]."""
        ranks = self.ranks_cpu if self.ranks_cpu is not None else self.ranks.cpu()
        scalings = self.scalings_cpu if self.scalings_cpu is not None else self.scalings.cpu()
        return ranks.tolist(), scalings.tolist()


class LoRABackend(Protocol):
    def prepare(self, token_slots: Tensor) -> LoRABatchInfo: ...

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        """out[t, off_s:off_s+1] += scalings[slot,s] * (x[t] @ A[slot,s,:r].T) @ B[slot,off_s:off_s+1,:r].T
        for every token t with slot >= 0 and every slice s with r = ranks[slot, s] > 0."""
        ...


class TorchLoRABackend:
    """Per-adapter grouped matmuls: each adapter's tokens (consecutive rows in place, others
    gathered once) are multiplied by that adapter's own rank-r matrices (no per-token weight
    gather, no max-rank compute). `bench/micro_lora.py` times it against its matmul-only floor."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, token_slots: Tensor) -> LoRABatchInfo:
        return build_batch_info(token_slots)

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        if not batch.has_lora:
            return
        if x.device.type != "cpu":
            self._apply(x, out, w, batch)
            return
        # On CPU the per-adapter matmuls are tiny (a few tokens x rank): splitting each across OpenMP
        # threads costs more than it saves, and a busy host that deschedules one thread stalls every
        # op. On one thread, mixed16 at concurrency 32 went from 42.9 to 71.0 tok/s (bench, 2 cores).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._apply(x, out, w, batch)
        finally:
            torch.set_num_threads(threads)

    def _apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        ranks, scalings = w.host_meta()
        in_place = out.dtype == x.dtype
        # A segment whose tokens are consecutive rows (a prefill chunk) is read and updated in
        # place. The others (decodes of one adapter spread over the batch) are gathered once into
        # one buffer, updated there, and scattered back with one index_add_.
        scattered: list[tuple[int, int, int]] = []
        for (slot, start, end), row in zip(batch.segments, batch.segment_rows, strict=True):
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


def get_backend(name: str, device: torch.device | str = "cpu") -> LoRABackend:
    """The LoRA backend called `name` ("torch" or "triton"; triton is imported lazily)."""
    if name == "torch":
        return TorchLoRABackend(device)
    if name == "triton":
        from .triton_backend import TritonLoRABackend

        return TritonLoRABackend()
    raise ValueError(f"unknown LoRA backend {name!r}; choose one of {', '.join(BACKENDS)}")
