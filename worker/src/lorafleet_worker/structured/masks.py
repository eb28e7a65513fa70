"""Grammar masks of a step, computed in a background thread while the forward pass runs.

Each constrained sequence carries a `GrammarMatcher` (its llguidance matcher). Before the engine runs
a step's forward pass it calls `GrammarMasks.start` with the rows that will sample; llguidance fills
one bitmask per constrained row (in parallel, without the GIL) while torch computes the logits; the
sampler then waits for the masks and applies them (sampling.sample). Free rows allow every token, and
a step without constrained rows costs nothing. As in vLLM, EOS is in a mask only where the grammar
accepts, so a constrained sequence ends only on a complete answer (or at max_tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np
import torch
from torch import Tensor

from lorafleet_worker.sample.sampler import SamplingState

log = logging.getLogger(__name__)


class GrammarMatcher:
    """One sequence's position in its grammar (a `sampling.TokenConstraint`)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):  # cannot happen for a masked draw; ends the sequence
            log.error("grammar rejected token %d: %s", token_id, self.matcher.get_error())


@dataclass
class MaskStats:
    """Counters of the mask thread (read by metrics and the benchmark)."""

    steps: int = 0  # steps with at least one constrained row
    rows: int = 0  # constrained rows masked
    compute_s: float = 0.0  # time spent filling masks (in the background thread)
    wait_s: float = 0.0  # time the step loop waited for them after its forward pass (the critical-path cost)


class PendingMasks:
    """The masks of one step, being computed; `wait` returns them as an [N, V] bool tensor."""

    def __init__(self, future: Future[Tensor] | None, stats: MaskStats) -> None:
        self._future = future
        self._stats = stats

    def wait(self, device: torch.device) -> Tensor | None:
        """True where a token is allowed (every token for a free row); None when no row is constrained."""
        if self._future is None:
            return None
        t0 = time.perf_counter()
        allowed = self._future.result()
        self._stats.wait_s += time.perf_counter() - t0
        return allowed.to(device, non_blocking=True)


class GrammarMasks:
    """Fills the token masks of constrained rows off the step loop's critical path."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.stats = MaskStats()
        self._thread: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, states: Sequence[SamplingState]) -> PendingMasks:
        """Begin computing the masks of `states` (one row each, in order)."""
        rows = [(st.constraint.matcher, i) for i, st in enumerate(states) if isinstance(st.constraint, GrammarMatcher)]
        if not rows:
            return PendingMasks(None, self.stats)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="lorafleet-grammar")
            self._executor = llguidance.LLExecutor()
        return PendingMasks(self._thread.submit(self._compute, rows, len(states)), self.stats)

    def _compute(self, rows: list[tuple[llguidance.LLMatcher, int]], n: int) -> Tensor:
        t0 = time.perf_counter()
        bitmask = llguidance.numpy.allocate_token_bitmask(n, self.vocab_size)  # all ones: every token allowed
        assert self._executor is not None
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        st = self.stats
        st.steps += 1
        st.rows += len(rows)
        st.compute_s += time.perf_counter() - t0
        return allowed

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
