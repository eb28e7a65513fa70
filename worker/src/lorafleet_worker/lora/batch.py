"""Per-step LoRA batch description, shared by every LoRA backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class LoRABatchInfo:
    """Tokens of one step grouped by GPU slot; built once per step by `LoRABackend.prepare`.

    Tokens without adapter (slot -1) sort first and get no segment, so `seg_indptr[0]` is
    the number of such tokens; segment i is `sorted_token_ids[seg_indptr[i]:seg_indptr[i+1]]`.
    `segments` repeats the segments host-side as `(slot, start, end)` for host loops;
    `segment_rows[i]` is the first row of segment i in the unsorted batch when its tokens are
    consecutive rows there (a prefill chunk, or decodes the scheduler placed side by side), else -1:
    such a segment can be read and updated in place, without a gather and a scatter.
    """

    token_slots: Tensor  # int32 [T], -1 = no adapter
    sorted_token_ids: Tensor  # int32 [T], stable permutation grouping tokens by slot
    seg_indptr: Tensor  # int32 [S+1] into sorted_token_ids, one segment per slot present
    seg_slots: Tensor  # int32 [S] (segments of slot -1 are dropped)
    max_seg_len: int
    num_tokens: int
    has_lora: bool
    segments: tuple[tuple[int, int, int], ...] = ()
    segment_rows: tuple[int, ...] = ()
    host_plan: Any = None  # backend-specific per-step data (the torch backend's `_Plan`), built by `prepare`


def build_batch_info(token_slots: Tensor) -> LoRABatchInfo:
    """Group the tokens of a step by slot (stable order); tokens of slot -1 get no segment.

    The grouping is computed host-side (one small copy) and the index tensors are placed on
    `token_slots`' device.
    """
    device = token_slots.device
    slots = token_slots.detach().to("cpu", torch.int32)
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    uniq, counts = torch.unique_consecutive(slots[order.long()], return_counts=True)
    segments: list[tuple[int, int, int]] = []
    rows: list[int] = []
    ids = order.tolist()
    start = 0
    for slot, count in zip(uniq.tolist(), counts.tolist(), strict=True):
        if slot >= 0:
            segments.append((slot, start, start + count))
            # stable sort: a segment's ids ascend, so they are consecutive iff last - first == count - 1
            rows.append(ids[start] if ids[start + count - 1] - ids[start] == count - 1 else -1)
        start += count
    indptr = [segments[0][1], *(end for _, _, end in segments)] if segments else [0]
    return LoRABatchInfo(
        token_slots=slots.to(device),
        sorted_token_ids=order.to(device),
        seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(device),
        seg_slots=torch.tensor([s for s, _, _ in segments], dtype=torch.int32).to(device),
        max_seg_len=max((end - begin for _, begin, end in segments), default=0),
        num_tokens=int(slots.numel()),
        has_lora=bool(segments),
        segments=tuple(segments),
        segment_rows=tuple(rows),
    )


def gathered_batch_info(token_slots: Tensor) -> LoRABatchInfo:
    """A step's description for the gathered kernels alone (`TritonLoRABackend`), built without reading
    `token_slots`: a CUDA graph's static buffer, whose values change from one replay to the next. The
    segment fields are empty: `max_seg_len` 1 makes the backend take the per-token gathered layout."""
    empty = token_slots.new_zeros(0)
    return LoRABatchInfo(
        token_slots=token_slots,
        sorted_token_ids=empty,
        seg_indptr=token_slots.new_zeros(1),
        seg_slots=empty,
        max_seg_len=1,
        num_tokens=int(token_slots.numel()),
        has_lora=True,
    )
