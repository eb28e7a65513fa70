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
    sorted_ids: tuple[int, ...] = ()  # `sorted_token_ids` host-side (empty from `gathered_batch_info`)
    host_plan: Any = None  # backend-specific per-step data (the torch backend's `_Plan`), built by `prepare`


def build_batch_info(token_slots: Tensor) -> LoRABatchInfo:
    """Group the tokens of a step by slot (stable order); tokens of slot -1 get no segment.

    The grouping is computed host-side from one copy of the slots, in Python (a step holds few tokens of few
    adapters: each torch op on such small tensors cost more than the loop, and every op hands the GIL to the
    server's thread), and the index tensors are placed on `token_slots`' device.
    """
    device = token_slots.device
    slots: list[int] = token_slots.tolist()
    ids = sorted(range(len(slots)), key=slots.__getitem__)  # stable: a slot's tokens keep their order
    segments: list[tuple[int, int, int]] = []
    rows: list[int] = []
    start = 0
    while start < len(ids):
        slot, end = slots[ids[start]], start + 1
        while end < len(ids) and slots[ids[end]] == slot:
            end += 1
        if slot >= 0:
            segments.append((slot, start, end))
            # a segment's ids ascend, so they are consecutive rows iff last - first == count - 1
            rows.append(ids[start] if ids[end - 1] - ids[start] == end - start - 1 else -1)
        start = end
    indptr = [segments[0][1], *(end for _, _, end in segments)] if segments else [0]
    host = token_slots.device.type == "cpu" and token_slots.dtype == torch.int32
    return LoRABatchInfo(
        token_slots=token_slots if host else torch.tensor(slots, dtype=torch.int32, device=device),
        sorted_token_ids=torch.tensor(ids, dtype=torch.int32, device=device),
        seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        seg_slots=torch.tensor([s for s, _, _ in segments], dtype=torch.int32, device=device),
        max_seg_len=max((end - begin for _, begin, end in segments), default=0),
        num_tokens=len(slots),
        has_lora=bool(segments),
        segments=tuple(segments),
        segment_rows=tuple(rows),
        sorted_ids=tuple(ids),
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
