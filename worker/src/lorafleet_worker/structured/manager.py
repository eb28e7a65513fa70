"""Structured output's one owner: it compiles constraints (with the compiler's cache), holds each request's
matcher, fills a step's token masks beside the forward pass and advances each matcher after sampling.

The compiler is built on first use (llguidance reads `tokenizer.json`: about half a second) and compiles off
the event loop. A request with a compiled grammar gets its own matcher when the scheduler adds it and loses
it when it ends. Before a step's forward pass the model runner calls `start_masks` with the requests of the
rows that will sample (and their draft tokens: a row each, masked as if the tokens before it were accepted);
llguidance fills one bitmask row per constrained request (in parallel, without the GIL) while torch computes
the logits, and the sampler then applies them. Free rows allow every token and a step without constrained rows
costs nothing. As in vLLM, EOS is allowed only where the grammar accepts, so a constrained sequence ends only
on a complete answer (or at max_tokens).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch
from torch import Tensor

from lorafleet_worker.structured.grammar import CompiledGrammar, CompilerStats, Constraint, GrammarCompiler

log = logging.getLogger(__name__)


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


class StructuredOutputManager:
    """Compiles constraints and owns every live request's matcher and the mask thread."""

    def __init__(self, tokenizer_dir: Path, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.mask_stats = MaskStats()
        self._tokenizer_dir = Path(tokenizer_dir)
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, llguidance.LLMatcher] = {}  # step thread only
        self._thread: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    # ------------------------------------------------------------------ compiling (any thread)

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, built on first use."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_model_dir(
                    self._tokenizer_dir, vocab_size=self.vocab_size, eos_token_ids=self._eos_token_ids
                )
            return self._compiler

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of `constraint` (cached); raises GrammarError. Blocks: call it off the event loop."""
        return self.compiler.compile(constraint)

    @property
    def compiler_stats(self) -> CompilerStats | None:
        return None if self._compiler is None else self._compiler.stats

    # ------------------------------------------------------------------ requests (step thread)

    def add_request(self, request_id: str, grammar: CompiledGrammar) -> None:
        """Give `request_id` its own matcher, at the start of `grammar`."""
        self._matchers[request_id] = grammar.matcher()

    def remove_request(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance the request's matcher over its sampled token (no-op for a free request)."""
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.consume_token(token_id):
            # cannot happen for a masked draw; the matcher is then in error, which ends the request
            log.error("grammar rejected token %d: %s", token_id, matcher.get_error())

    def finished(self, request_id: str) -> bool:
        """True once the request's grammar admits no more tokens (never for a free request)."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and (matcher.is_stopped() or matcher.is_error())

    def valid_prefix(self, request_id: str, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` that the request's grammar accepts from where it is (all of it for a
        free request); the matcher does not move."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not draft:
            return draft
        return draft[: matcher.validate_tokens(draft)]

    def forced_tokens(self, request_id: str) -> list[int]:
        """The tokens the request's grammar allows as its only continuation from here (jump-forward), [] for a
        free request or where the grammar leaves a choice."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_stopped() or matcher.is_error():
            return []
        return list(matcher.compute_ff_tokens())

    def start_masks(self, request_ids: Sequence[str], drafts: Sequence[Sequence[int]] | None = None) -> PendingMasks:
        """Begin filling the masks of a step's sampling rows in the mask thread: per request (in order) one row,
        and one more per token of its draft (`drafts`, one per request: the mask after the draft tokens
        before it)."""
        todo, n = [], 0
        for rid, draft in zip(request_ids, drafts or [()] * len(request_ids), strict=True):
            matcher = self._matchers.get(rid)
            if matcher is not None:
                todo.append((matcher, n, list(draft)))
            n += 1 + len(draft)
        if not todo:
            return PendingMasks(None, self.mask_stats)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="lorafleet-grammar")
            self._executor = llguidance.LLExecutor()
        return PendingMasks(self._thread.submit(self._fill, todo, n), self.mask_stats)

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]], n: int) -> Tensor:
        t0 = time.perf_counter()
        bitmask = llguidance.numpy.allocate_token_bitmask(n, self.vocab_size)  # all ones: every token allowed
        assert self._executor is not None
        if any(draft for _, _, draft in rows):
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, rows, bitmask)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for m, i, _ in rows], bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        st = self.mask_stats
        st.steps += 1
        st.rows += len(rows)
        st.compute_s += time.perf_counter() - t0
        return allowed

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._matchers.clear()
