"""`LoRAProjWeights`: the slot pool's tensors for one (layer, projection group), as every LoRA backend reads them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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
    slot_adapted: list[bool] | None = None  # host: slot holds an adapter adapting some slice (None: unknown)

    @property
    def n_slices(self) -> int:
        return len(self.slice_offsets) - 1

    def host_meta(self) -> tuple[list[list[int]], list[list[float]]]:
        """(ranks, scalings) as host lists indexed [slot][slice]."""
        ranks = self.ranks_cpu if self.ranks_cpu is not None else self.ranks.cpu()
        scalings = self.scalings_cpu if self.scalings_cpu is not None else self.scalings.cpu()
        return ranks.tolist(), scalings.tolist()
