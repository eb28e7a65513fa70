"""LoRAPool: stacked per-slot LoRA buffers on the compute device, one set per (layer, group)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .adapter import LoRAAdapter, group_shapes
from .weights import LoRAProjWeights

# what the CPU kernel reads of one (layer, group): A, B, host ranks, host scalings, slice offsets, slot flags
KernelArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[bool]]


class LoRAPool:
    """`num_slots` GPU slots; slot i of every (layer, group) buffer holds one adapter's weights.

    B is `[num_slots, out_total, max_rank]` in every layout. Rank-major (the default on CPU) makes it a
    transposed view of a `[num_slots, max_rank, out_total]` buffer: the CPU kernel (`cpu_lora`) then
    expands with contiguous rows of B, and the torch path's `B[slot, cols, :r].t()` is a contiguous
    matrix. The Triton kernels read the out-major layout (rank stride 1): the engine asks for it."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_slots: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        rank_major_b: bool | None = None,
    ) -> None:
        """`rank_major_b`: store B rank-major (for the torch backend's CPU kernel; the Triton kernels need the
        out-major layout); None = rank-major on CPU."""
        if num_slots < 1 or max_rank < 1:
            raise ValueError("a LoRA pool needs at least one slot and max_rank >= 1")
        self.config = config
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.rank_major_b = self.device.type == "cpu" if rank_major_b is None else rank_major_b
        self._weights: dict[tuple[int, str], LoRAProjWeights] = {}
        self._kernel_table: dict[tuple[int, str], KernelArgs] | None = None
        for layer in range(config.num_hidden_layers):
            for group, shape in group_shapes(config).items():
                n, out_total = len(shape.slice_widths), shape.slice_offsets[-1]
                if self.rank_major_b:  # see the class doc
                    b = torch.zeros(num_slots, max_rank, out_total, device=self.device, dtype=dtype).transpose(1, 2)
                else:
                    b = torch.zeros(num_slots, out_total, max_rank, device=self.device, dtype=dtype)
                self._weights[(layer, group)] = LoRAProjWeights(
                    A=torch.zeros(num_slots, n, max_rank, shape.in_dim, device=self.device, dtype=dtype),
                    B=b,
                    ranks=torch.zeros(num_slots, n, device=self.device, dtype=torch.int32),
                    scalings=torch.zeros(num_slots, n, device=self.device, dtype=torch.float32),
                    slice_offsets=shape.slice_offsets,
                    ranks_cpu=torch.zeros(num_slots, n, dtype=torch.int32),
                    scalings_cpu=torch.zeros(num_slots, n, dtype=torch.float32),
                    slot_adapted=[False] * num_slots,
                )

    def weights(self, layer: int, group: str) -> LoRAProjWeights:
        return self._weights[(layer, group)]

    def kernel_table(self) -> dict[tuple[int, str], KernelArgs]:
        """(layer, group) -> what the CPU kernel reads of it (`cpu_lora.kernel`): A, B, the host ranks and
        scalings, the slice offsets as a list, and the per-slot "adapts this group" flags. Built once: these
        are the pool's own tensors and list, which `write_slot` updates in place."""
        if self._kernel_table is None:
            table = {}
            for key, w in self._weights.items():
                assert w.ranks_cpu is not None and w.scalings_cpu is not None and w.slot_adapted is not None
                table[key] = (w.A, w.B, w.ranks_cpu, w.scalings_cpu, list(w.slice_offsets), w.slot_adapted)
            self._kernel_table = table
        return self._kernel_table

    @property
    def nbytes(self) -> int:
        return sum(w.A.nbytes + w.B.nbytes for w in self._weights.values())

    @torch.no_grad()
    def write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Overwrite every buffer of `slot` with `adapter` (None clears it): unused rows, ranks
        and slices are zeroed, so nothing of a previous occupant survives."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        if adapter is not None and adapter.max_rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.max_rank} exceeds the pool's max rank {self.max_rank}")
        for key, w in self._weights.items():
            w.A[slot].zero_()
            w.B[slot].zero_()
            assert w.ranks_cpu is not None and w.scalings_cpu is not None
            w.ranks_cpu[slot].zero_()
            w.scalings_cpu[slot].zero_()
            if w.slot_adapted is not None:
                w.slot_adapted[slot] = False
            mods = adapter.modules.get(key) if adapter is not None else None
            for s, m in enumerate(mods or ()):
                if m is None:
                    continue
                lo, hi = w.slice_offsets[s], w.slice_offsets[s + 1]
                w.A[slot, s, : m.rank].copy_(m.A)
                w.B[slot, lo:hi, : m.rank].copy_(m.B)
                w.ranks_cpu[slot, s] = m.rank
                w.scalings_cpu[slot, s] = m.scaling
                if w.slot_adapted is not None:
                    w.slot_adapted[slot] = True
            w.ranks[slot].copy_(w.ranks_cpu[slot])
            w.scalings[slot].copy_(w.scalings_cpu[slot])
