"""The interface every LoRA backend implements: prepare a step's batch description, apply one projection's delta."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from ..batch import LoRABatchInfo
from ..weights import LoRAProjWeights

if TYPE_CHECKING:
    from ..pool import LoRAPool

StepRunner = Callable[[int, str, Tensor, Tensor], None]  # (layer, group, x, out): out += the step's LoRA delta


class LoRABackend(Protocol):
    def prepare(self, token_slots: Tensor) -> LoRABatchInfo:
        """The step's batch description (`LoRABatchInfo`, with the backend's own `host_plan` if it needs one)."""
        ...

    def apply(self, x: Tensor, out: Tensor, w: LoRAProjWeights, batch: LoRABatchInfo) -> None:
        """out[t, off_s:off_s+1] += scalings[slot,s] * (x[t] @ A[slot,s,:r].T) @ B[slot,off_s:off_s+1,:r].T
        for every token t with slot >= 0 and every slice s with r = ranks[slot, s] > 0."""
        ...

    def step_runner(self, pool: LoRAPool, batch: LoRABatchInfo) -> StepRunner | None:
        """A faster `apply` for every (layer, group) of this step, or None: `apply` serves the step."""
        ...
