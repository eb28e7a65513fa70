"""`CpuLoRABackend`: multi-LoRA on CPU, each adapter's short segments in the grouped C++ kernel (`ops/cpu_lora.py`).

Per projection group and step:
  - every adapter with at most `SMALL_SEGMENT` tokens in the step (decode tokens, short prompt chunks) goes
    through ONE `cpu_lora.lora_small` call: each adapter's own rank, the rows read and updated in place,
    the work split over ATen's threads;
  - larger segments (long prompt chunks) run the torch backend's per-adapter matmuls.
In bfloat16 on a CPU without bfloat16 matmul units (no AVX512-BF16 / AMX) the large segments go to the
kernel too: torch's bf16 mm / addmm_ there is a slow emulation. No op changes torch's thread count.
`bench/micro_lora.py` times it against the torch backend and their matmul-only floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...host.devices import cpu_bf16_flag
from ..batch import LoRABatchInfo, build_batch_info
from ..weights import LoRAProjWeights
from .base import StepRunner
from .torch import Segment, TorchLoRABackend

if TYPE_CHECKING:
    from ..pool import LoRAPool

# An adapter with at most this many tokens in the step goes to the grouped C++ kernel; one with more (a long
# prompt chunk) to per-adapter matmuls, which win on FLOPs once a segment is long (`bench/micro_lora.py`).
SMALL_SEGMENT = 512


@dataclass
class _Plan:
    """How the CPU backend splits one step (host-side, built once per step by `prepare`).

    Large segments (long prompt chunks) run per-adapter matmuls, whose cost is their FLOPs; the small ones
    (each adapter's decode tokens, short prompt chunks) go to one grouped kernel call per projection group.
    """

    slots: tuple[int, ...]  # every slot of the step
    large: tuple[Segment, ...]
    small: tuple[Segment, ...]
    small_rows: Tensor  # int32: the rows of the small segments' tokens, segment after segment
    small_segs: Tensor  # int64 [S, 3]: (slot, start, end) into small_rows
    all_grouped: _Plan | None = None  # the same step with every segment small (`CpuLoRABackend.apply`)


def make_plan(batch: LoRABatchInfo, small_segment: int = SMALL_SEGMENT) -> _Plan:
    """Split `batch`'s segments at `small_segment` tokens (0: every segment is large)."""
    ids = batch.sorted_ids
    large: list[Segment] = []
    small: list[Segment] = []
    seg_rows: list[tuple[int, int, int]] = []
    small_rows: list[int] = []
    for (slot, start, end), row in zip(batch.segments, batch.segment_rows, strict=True):
        if end - start > small_segment:
            large.append((slot, start, end, row))
        else:
            small.append((slot, start, end, row))
            seg_rows.append((slot, len(small_rows), len(small_rows) + end - start))
            small_rows.extend(ids[start:end])
    return _Plan(
        slots=tuple(s for s, _, _ in batch.segments),
        large=tuple(large),
        small=tuple(small),
        small_rows=torch.tensor(small_rows, dtype=torch.int32),
        small_segs=torch.tensor(seg_rows, dtype=torch.int64).reshape(-1, 3),
    )


class CpuLoRABackend(TorchLoRABackend):
    """The torch backend with the short segments in one grouped C++ kernel call (the default on CPU where the
    kernel builds; `LORAFLEET_CPU_LORA=torch` or no compiler: `TorchLoRABackend`)."""

    grouped = "cpp"

    def __init__(self, small_segment: int = SMALL_SEGMENT) -> None:
        from lorafleet_worker.ops import cpu_lora

        if not cpu_lora.available():
            raise ValueError(f"the CPU LoRA kernel is not available (see the log; {cpu_lora.ENV})")
        super().__init__("cpu")
        self.small_segment = small_segment

    def prepare(self, token_slots: Tensor) -> LoRABatchInfo:
        batch = build_batch_info(token_slots)
        batch.host_plan = make_plan(batch, self.small_segment)
        return batch

    def step_runner(self, pool: LoRAPool, batch: LoRABatchInfo) -> StepRunner | None:
        """For a step whose every segment goes to the C++ kernel (decode steps), the step's `apply` with the
        per-call Python cut to a table look-up and the kernel call (a step calls it for every layer and
        projection group); None where `apply` has to run (prefill segments, another dtype).
        Inputs `apply` would not hand to the kernel (another dtype, strided rows) still go to `apply`."""
        plan = batch.host_plan
        dtype = pool.dtype
        if (
            not batch.has_lora
            or not isinstance(plan, _Plan)
            or plan.large
            or not plan.small
            or pool.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)
        ):
            return None
        from lorafleet_worker.ops import cpu_lora

        kernel = cpu_lora.kernel()
        table = pool.kernel_table()
        rows, segs, slots = plan.small_rows, plan.small_segs, plan.slots
        only = slots[0] if len(slots) == 1 else None

        def run(layer: int, group: str, x: Tensor, out: Tensor) -> None:
            A, B, ranks, scalings, offsets, adapted = table[layer, group]
            if not (adapted[only] if only is not None else any(adapted[s] for s in slots)):
                return  # no adapter of the step adapts this group
            if x.dtype != dtype or out.dtype != dtype or x.stride(-1) != 1 or out.stride(-1) != 1:
                self.apply(x, out, pool.weights(layer, group), batch)
                return
            kernel(x, out, A, B, ranks, scalings, offsets, rows, segs)

        return run

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        if not batch.has_lora:
            return
        plan = batch.host_plan
        if not isinstance(plan, _Plan):  # a batch from another backend's prepare
            plan = batch.host_plan = make_plan(batch, self.small_segment)
        adapted = w.slot_adapted
        if adapted is not None and not any(adapted[s] for s in plan.slots):
            return  # no adapter of the step adapts this group (e.g. q/v-only adapters on the MLP)
        kernel = (
            x.device.type == "cpu"
            and x.dtype == out.dtype == w.A.dtype == w.B.dtype
            and x.dtype in (torch.float32, torch.bfloat16)
            and out.stride(-1) == 1
        )
        if kernel and plan.large and x.dtype == torch.bfloat16 and cpu_bf16_flag() is None:
            # without bfloat16 matmul units (AMX / AVX512-BF16; the flag is cached) torch's bf16 mm / addmm_ is an
            # emulation, far slower than the kernel: every segment goes to it
            if plan.all_grouped is None:
                plan.all_grouped = make_plan(batch, batch.num_tokens)
            plan = plan.all_grouped
        if plan.large:
            self._per_adapter(x, out, w, batch, plan.large)
        if not plan.small:
            return
        if kernel:
            from lorafleet_worker.ops import cpu_lora

            ranks = w.ranks_cpu if w.ranks_cpu is not None else w.ranks.cpu()
            scalings = w.scalings_cpu if w.scalings_cpu is not None else w.scalings.cpu()
            x2 = x if x.stride(-1) == 1 else x.contiguous()
            cpu_lora.lora_small(x2, out, w.A, w.B, ranks, scalings, w.slice_offsets, plan.small_rows, plan.small_segs)
        else:
            self._per_adapter(x, out, w, batch, plan.small)
