"""Continuous batching: which tokens of which sequences run in the next step.

Each step runs, in order: one decode token of every running sequence that has finished its
prompt, the next chunk of prompts still being prefilled, then new sequences admitted from the
waiting queue (FIFO) while the token budget, `max_num_seqs`, KV blocks and LoRA slots allow.

LoRA slots: a sequence with an adapter is admitted only once `manager.activate(ref)` gives it a
GPU slot (pinned until the sequence ends), so a step never holds more distinct adapters than there
are slots (`max_loras`). A sequence that cannot get a slot waits and later ones may pass it, until
it has waited `slot_aging_s`: from then on no new sequence that needs a slot is admitted, so slots
drain to it (no starvation). Out of KV blocks, the newest running sequence is preempted (its blocks
are freed and it is recomputed later; it keeps its slot and its queue position). A sequence whose
adapter weights are being read back from disk (`manager.weights_ready`) waits without holding anything.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet_worker.kv_cache import PagedKVCache
from lorafleet_worker.sampling import SamplingParams, SamplingState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    request_id: str
    tokens: list[int]  # prompt + generated tokens
    num_prompt: int
    params: SamplingParams
    max_len: int  # the sequence ends ("length") when len(tokens) reaches it
    adapter: str | None = None
    ref: Any = None  # AdapterRef pinning the adapter version, None for the base model
    sampling: SamplingState | None = None  # generator, logits processors, grammar (set by the engine)
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    slot: int = -1  # GPU LoRA slot while running, -1 = base model
    slot_wait_since: float | None = None
    finish_reason: str | None = None
    # (logprob, top-k) of prompt tokens 1.. when params.prompt_logprobs is set (filled as the prompt is computed)
    prompt_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so its last logits give the next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token (empty unless asked, or done)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None:
            return range(0)
        start = max(seq.num_computed, len(seq.prompt_logprobs))  # a recomputed prompt is not scored twice
        return range(start, min(seq.num_computed + self.num_tokens, seq.num_prompt - 1))


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]  # single-token (decode) chunks first, then prefill chunks
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def slots(self) -> set[int]:
        return {c.seq.slot for c in self.chunks if c.seq.slot >= 0}


class Scheduler:
    """Owns the waiting queue, the running set, KV blocks and slot pins of every live sequence."""

    def __init__(
        self,
        kv: PagedKVCache,
        manager: Any,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int,
        slot_aging_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.slot_aging_s = slot_aging_s
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.watermark_blocks = max(1, kv.num_blocks // 100)
        self.failed: list[tuple[Sequence, Exception]] = []  # sequences that could not start; drained by the engine

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_for_slot(self) -> int:
        return sum(1 for s in self.waiting if s.slot_wait_since is not None)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`: leave the queues, free its blocks, release its adapter ref. Idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.release(seq.blocks)
        if seq.ref is not None:
            self.manager.release(seq.ref)
            seq.ref = None
        seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.blocks)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        # back into the queue at its arrival position (the queue is ordered by arrival)
        pos = next((i for i, s in enumerate(self.waiting) if s.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(pos, seq)

    # ------------------------------------------------------------------ step

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        preemptions = self.num_preemptions
        for seq in sorted(self.running, key=lambda s: s.arrival):  # oldest first: they are preempted last
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted by an older sequence this step
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._reserve(seq, n, scheduled):
                continue
            chunks.append(ScheduledChunk(seq, n))
            scheduled.add(id(seq))
            budget -= n
        if self.num_preemptions == preemptions:  # memory is short when running sequences were preempted
            self._admit(chunks, budget, {c.seq.slot for c in chunks if c.seq.slot >= 0})
        # decode tokens first, grouped by LoRA slot: each adapter's decodes are then consecutive rows,
        # which the LoRA backends update in place (no gather/scatter); prefill chunks keep their order
        chunks.sort(key=lambda c: (c.num_tokens != 1, c.seq.slot if c.num_tokens == 1 else 0))
        return StepPlan(chunks, sum(1 for c in chunks if c.num_tokens == 1))

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Grow `seq`'s blocks for `n` more tokens, preempting the newest unscheduled sequences if needed."""
        while not self.kv.grow(seq.blocks, seq.num_computed + n):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(max(victims, key=lambda s: s.arrival))
        return True

    def _admit(self, chunks: list[ScheduledChunk], budget: int, slots: set[int]) -> None:
        now = self.clock()
        slots_blocked = False  # an aged sequence waits for a slot: admit no new slot users
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            needs_slot = seq.ref is not None and seq.slot < 0  # a preempted sequence keeps its slot
            if needs_slot and slots_blocked:
                seq.slot_wait_since = seq.slot_wait_since if seq.slot_wait_since is not None else now
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            # keep a few blocks for the decodes of running sequences (fewer preemptions), unless idle
            reserve = self.watermark_blocks if self.running else 0
            if self.kv.blocks_for(seq.num_computed + n) - len(seq.blocks) > self.kv.allocator.num_free - reserve:
                break  # FIFO on memory: later sequences do not overtake one that does not fit
            if seq.ref is not None:
                try:
                    if needs_slot and not self.manager.weights_ready(seq.ref):
                        continue  # read back from disk off this thread; the others keep running
                    slot = seq.slot if seq.slot >= 0 else self.manager.activate(seq.ref)
                except Exception as exc:  # e.g. the adapter's files vanished before a reload
                    self.finish(seq, "abort")
                    self.failed.append((seq, exc))
                    continue
                if slot is None or (slot not in slots and len(slots) >= self.max_loras):
                    seq.slot_wait_since = seq.slot_wait_since if seq.slot_wait_since is not None else now
                    if now - seq.slot_wait_since >= self.slot_aging_s:
                        slots_blocked = True
                    continue
                seq.slot = slot
                seq.slot_wait_since = None
                slots.add(slot)
            grown = self.kv.grow(seq.blocks, seq.num_computed + n)
            assert grown, "free blocks were checked above"
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
