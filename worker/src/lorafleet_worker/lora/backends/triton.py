"""`TritonLoRABackend`: the `LoRABackend` interface on the Triton shrink/expand kernels (kernels/lora.py).

Per projection: one shrink launch (x · Aᵀ into an fp32 `[T, n_slices, max_rank]` buffer) and one expand
launch (scaled · Bᵀ added into `out`), each covering every adapter and slice of the batch.

Layout choice by batch shape: when no adapter has more than `GATHERED_MAX_SEG_LEN` tokens in the step
(decode with many distinct adapters), or the whole step has at most `GATHERED_MAX_TOKENS` tokens (a decode
batch, even one where every sequence shares one adapter), the per-token gathered kernels run: one program per
token and rank block, enough to fill the GPU, re-reading a shared adapter's weights from L2. Otherwise
(prefill) the segmented kernels run, which read each adapter's weights once per tile of up to 64 of its
tokens; on a decode batch of one adapter they would run only a few programs for the whole step (one per
slice), which left the GPU nearly idle during the shrink (bench/README.md, "GPU").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lorafleet_worker.kernels.lora import Segments, lora_expand, lora_shrink

from ..batch import LoRABatchInfo, build_batch_info
from ..weights import LoRAProjWeights
from .base import StepRunner

if TYPE_CHECKING:
    from ..pool import LoRAPool

GATHERED_MAX_SEG_LEN = 4
GATHERED_MAX_TOKENS = 256


class TritonLoRABackend:
    """Multi-LoRA on Triton kernels (CUDA; CPU only under `TRITON_INTERPRET=1`)."""

    def __init__(
        self, gathered_max_seg_len: int = GATHERED_MAX_SEG_LEN, gathered_max_tokens: int | None = None
    ) -> None:
        self.gathered_max_seg_len = gathered_max_seg_len
        self.gathered_max_tokens = GATHERED_MAX_TOKENS if gathered_max_tokens is None else gathered_max_tokens
        self._offsets: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}

    def prepare(self, token_slots: Tensor) -> LoRABatchInfo:
        return build_batch_info(token_slots)

    def step_runner(self, pool: LoRAPool, batch: LoRABatchInfo) -> StepRunner | None:
        return None

    def use_gathered(self, batch: LoRABatchInfo) -> bool:
        """The per-token gathered layout when every adapter has at most a few tokens in the step, or the step
        is decode-sized."""
        return batch.max_seg_len <= self.gathered_max_seg_len or batch.num_tokens <= self.gathered_max_tokens

    def _slice_offsets(self, offsets: tuple[int, ...], device: torch.device) -> Tensor:
        key = (offsets, device)
        t = self._offsets.get(key)
        if t is None:
            t = self._offsets[key] = torch.tensor(offsets, dtype=torch.int32).to(device)
        return t

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        """out[t, slice s] += scalings[slot, s] · x[t] · A[slot, s, :r]ᵀ · B[slot, slice s, :r]ᵀ (see LoRABackend)."""
        if not batch.has_lora:
            return
        num_tokens = batch.num_tokens
        x2 = x.reshape(num_tokens, -1)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if x2.dtype != w.A.dtype:
            x2 = x2.to(w.A.dtype)
        out2 = out.view(num_tokens, -1)
        target = out2 if out2.dtype == w.B.dtype else torch.zeros(out2.shape, dtype=w.B.dtype, device=out2.device)
        xa = torch.empty((num_tokens, w.n_slices, w.A.shape[2]), dtype=torch.float32, device=x2.device)
        offsets = w.slice_offsets
        max_width = max(offsets[s + 1] - offsets[s] for s in range(w.n_slices))
        gathered = self.use_gathered(batch)
        token_slots = batch.token_slots if gathered else None
        segments = (
            None if gathered else Segments(batch.sorted_token_ids, batch.seg_indptr, batch.seg_slots, batch.max_seg_len)
        )
        lora_shrink(x2, w.A, w.ranks, xa, token_slots=token_slots, segments=segments)
        offs = self._slice_offsets(offsets, out2.device)
        lora_expand(xa, w.B, w.ranks, w.scalings, offs, max_width, target, token_slots=token_slots, segments=segments)
        if target is not out2:
            out2 += target.to(out2.dtype)
