"""The LoRA seam between the model and the slot pool: weights views, backend protocol, torch backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from ..host.devices import cpu_bf16_flag
from .batch import LoRABatchInfo, build_batch_info

if TYPE_CHECKING:
    from .pool import LoRAPool

BACKENDS = ("torch", "triton")
StepRunner = Callable[[int, str, Tensor, Tensor], None]  # (layer, group, x, out): out += the step's LoRA delta


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


class LoRABackend(Protocol):
    def prepare(self, token_slots: Tensor) -> LoRABatchInfo: ...

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        """out[t, off_s:off_s+1] += scalings[slot,s] * (x[t] @ A[slot,s,:r].T) @ B[slot,off_s:off_s+1,:r].T
        for every token t with slot >= 0 and every slice s with r = ranks[slot, s] > 0."""
        ...


# An adapter with at most this many tokens in the step goes to the grouped C++ kernel; one with more (a long
# prompt chunk) to per-adapter matmuls, which win on FLOPs once a segment is long. Measured with the server at
# c = 32 (w8a8_int8, real model, 2026-11-27; `bench/README.md` "Eleventh pass"), tok/s at 128 -> 512: mixed16 (16
# adapters, two 128-token prompts each a step) 298-317 -> 333-344, trained4 373 -> 396; one adapter (a 2048-token
# segment) 446 at 512 against 430 with that segment in the kernel too.
SMALL_SEGMENT = 512
GROUPED = ("cpp", "torch")

Segment = tuple[int, int, int, int]  # (slot, start, end) into sorted_token_ids, first row of its tokens or -1


@dataclass
class _Plan:
    """How the torch backend splits one step (host-side, built once per step by `prepare`).

    Large segments (long prompt chunks) run per-adapter matmuls, whose cost is their FLOPs; the small ones
    (each adapter's decode tokens, short prompt chunks) go to one grouped kernel call per projection group.
    """

    slots: tuple[int, ...]  # every slot of the step
    large: tuple[Segment, ...]
    small: tuple[Segment, ...]
    small_rows: Tensor  # int32: the rows of the small segments' tokens, segment after segment
    small_segs: Tensor  # int64 [S, 3]: (slot, start, end) into small_rows
    all_grouped: _Plan | None = None  # the same step with every segment small (`TorchLoRABackend.apply`)


def make_plan(batch: LoRABatchInfo, small_segment: int = SMALL_SEGMENT) -> _Plan:
    """Split `batch`'s segments at `small_segment` tokens (0: every segment is large)."""
    ids = batch.sorted_token_ids.cpu()
    large: list[Segment] = []
    small: list[Segment] = []
    seg_rows, pieces = [], []
    pos = 0
    for (slot, start, end), row in zip(batch.segments, batch.segment_rows, strict=True):
        if end - start > small_segment:
            large.append((slot, start, end, row))
        else:
            small.append((slot, start, end, row))
            seg_rows.append((slot, pos, pos + end - start))
            pieces.append(ids[start:end])
            pos += end - start
    return _Plan(
        slots=tuple(s for s, _, _ in batch.segments),
        large=tuple(large),
        small=tuple(small),
        small_rows=torch.cat(pieces).to(torch.int32) if pieces else torch.empty(0, dtype=torch.int32),
        small_segs=torch.tensor(seg_rows, dtype=torch.int64).reshape(-1, 3),
    )


class TorchLoRABackend:
    """Multi-LoRA without Triton (the CPU backend; on CUDA the reference of the Triton kernels).

    Per projection group and step, on CPU with the C++ kernel (`cpu_lora`, the default where it builds):
      - every adapter with at most `SMALL_SEGMENT` tokens in the step (decode tokens, short prompt chunks) goes
        through ONE `cpu_lora.lora_small` call: each adapter's own rank, the rows read and updated in place,
        the work split over ATen's threads;
      - larger segments (long prompt chunks) run their own rank-r matmuls, one shrink mm and one in-place addmm_
        per slice, in place when their tokens are consecutive rows (else gathered once, index_add_ back).
    In bfloat16 on a CPU without bfloat16 matmul units (no AVX512-BF16 / AMX) the large segments go to the
    kernel too: torch's bf16 mm / addmm_ there is a slow emulation. Without the kernel (`grouped="torch"`,
    `LORAFLEET_CPU_LORA=torch`, no compiler, CUDA, float16) every segment takes the per-adapter matmuls.
    No op changes torch's thread count. `bench/micro_lora.py` times both against their matmul-only floor.
    """

    step_runners = True  # the decode fast path below; instrumentation that times `apply` turns it off

    def __init__(self, device: torch.device | str = "cpu", grouped: str | None = None) -> None:
        """`grouped`: "cpp" (the C++ kernel for small segments) or "torch" (per-adapter matmuls only);
        None = "cpp" on CPU where the kernel builds, else "torch"."""
        self.device = torch.device(device)
        if grouped is None:
            from . import cpu_lora

            grouped = "cpp" if self.device.type == "cpu" and cpu_lora.available() else "torch"
        if grouped not in GROUPED:
            raise ValueError(f"grouped path {grouped!r}: choose one of {', '.join(GROUPED)}")
        if grouped == "cpp":
            from . import cpu_lora

            if not cpu_lora.available():
                raise ValueError(f"the CPU LoRA kernel is not available (see the log; {cpu_lora.ENV})")
        self.grouped = grouped
        self.small_segment = SMALL_SEGMENT if grouped == "cpp" else 0

    def prepare(self, token_slots: Tensor) -> LoRABatchInfo:
        batch = build_batch_info(token_slots)
        batch.host_plan = make_plan(batch, self.small_segment)
        return batch

    def step_runner(self, pool: LoRAPool, batch: LoRABatchInfo) -> StepRunner | None:
        """For a step whose every segment goes to the C++ kernel (decode steps), the step's `apply` with the
        per-call Python cut to a table look-up and the kernel call (one user decoding calls it 120 times a
        step on a 30-layer model, ~8 µs of Python each through `apply`); None where `apply` has to run (prefill
        segments, the torch path, another dtype, or `step_runners` turned off, e.g. by a benchmark timing `apply`).
        Inputs `apply` would not hand to the kernel (another dtype, strided rows) still go to `apply`."""
        plan = batch.host_plan
        dtype = pool.dtype
        if (
            self.grouped != "cpp"
            or not self.step_runners
            or not batch.has_lora
            or not isinstance(plan, _Plan)
            or plan.large
            or not plan.small
            or pool.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)
        ):
            return None
        from . import cpu_lora

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
            self.grouped == "cpp"
            and x.device.type == "cpu"
            and x.dtype == out.dtype == w.A.dtype == w.B.dtype
            and x.dtype in (torch.float32, torch.bfloat16)
            and out.stride(-1) == 1
        )
        if kernel and plan.large and x.dtype == torch.bfloat16 and cpu_bf16_flag() is None:
            # without bfloat16 matmul units (AMX / AVX512-BF16; the flag is cached) torch's bf16 mm / addmm_ ran
            # ~10x slower than the kernel (prefill with an adapter, bench/README.md): every segment goes to it
            if plan.all_grouped is None:
                plan.all_grouped = make_plan(batch, batch.num_tokens)
            plan = plan.all_grouped
        if plan.large:
            self._per_adapter(x, out, w, batch, plan.large)
        if not plan.small:
            return
        if kernel:
            from . import cpu_lora

            ranks = w.ranks_cpu if w.ranks_cpu is not None else w.ranks.cpu()
            scalings = w.scalings_cpu if w.scalings_cpu is not None else w.scalings.cpu()
            x2 = x if x.stride(-1) == 1 else x.contiguous()
            cpu_lora.lora_small(x2, out, w.A, w.B, ranks, scalings, w.slice_offsets, plan.small_rows, plan.small_segs)
        else:
            self._per_adapter(x, out, w, batch, plan.small)

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


def get_backend(name: str, device: torch.device | str = "cpu") -> LoRABackend:
    """The LoRA backend called `name` ("torch" or "triton"; triton is imported lazily)."""
    if name == "torch":
        return TorchLoRABackend(device)
    if name == "triton":
        from .triton_backend import TritonLoRABackend

        return TritonLoRABackend()
    raise ValueError(f"unknown LoRA backend {name!r}; choose one of {', '.join(BACKENDS)}")
