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

Prefix caching (`enable_prefix_caching`): after each step `update` caches every block a sequence
filled, under a hash chained over the tokens of its prefix and the adapter's identity (name and
weights' content hash, `AdapterRef.identity`); a sequence being admitted (new, or preempted) starts
from the longest run of its full blocks that the pool still has. At least its last token is always
computed (it gives the logits to sample from); a request for prompt logprobs computes its whole prompt.

`update` alone moves sequences on after a step: computed tokens, cached blocks, sampled tokens and
finish reasons.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet_worker.core.kv_cache import ROOT_HASH, PagedKVCache, hash_block
from lorafleet_worker.sample.sampler import SamplingParams, SamplingState


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
    cache_key: bytes = b""  # the adapter's identity in block hashes (set by Scheduler.add)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of `tokens` hashed so far
    num_cached_blocks: int = 0  # leading blocks of `blocks` that are in the prefix cache

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
class StepUpdate:
    """What `Scheduler.update` did: the sequences that ended (with their reason) and the prompt tokens computed."""

    finished: dict[Sequence, str]
    prompt_tokens: int


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
        enable_prefix_caching: bool = True,
        eos_token_ids: Collection[int] = (),
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
        self.failed: list[tuple[Sequence, Exception]] = []  # sequences that could not start (`take_failed`)
        self.enable_prefix_caching = enable_prefix_caching
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache_queries = 0  # prompt tokens of sequences that looked the cache up (vLLM's counters)
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.cache_key = seq.ref.identity if seq.ref is not None else b""
        self.waiting.append(seq)

    def take_failed(self) -> list[tuple[Sequence, Exception]]:
        """The sequences that could not start since the last call, with why (already finished)."""
        failed, self.failed = self.failed, []
        return failed

    @property
    def num_free_blocks(self) -> int:
        """KV blocks no sequence holds (cached ones included: they are reclaimed on demand)."""
        return self.kv.pool.num_free

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
        seq.num_cached_blocks = 0
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
            hits = self._lookup(seq)
            computed = seq.num_computed + len(hits) * self.kv.block_size
            n = min(len(seq.tokens) - computed, budget)
            # keep a few blocks for the decodes of running sequences (fewer preemptions), unless idle
            reserve = self.watermark_blocks if self.running else 0
            pool = self.kv.pool
            need = self.kv.blocks_for(computed + n) - len(seq.blocks) - len(hits) + pool.num_unheld(hits)
            if need > pool.num_free - reserve:
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
            if self._looks_up(seq):
                self.prefix_cache_queries += len(seq.tokens)
                self.prefix_cache_hits += computed - seq.num_computed
            pool.hold(hits)
            seq.blocks.extend(hits)
            seq.num_cached_blocks = len(hits)
            seq.num_computed = computed
            grown = self.kv.grow(seq.blocks, computed + n)
            assert grown, "free blocks were checked above"
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n

    # ------------------------------------------------------------------ after a step

    def update(self, plan: StepPlan, sampled: Mapping[Sequence, int]) -> StepUpdate:
        """Move every sequence of `plan` on after its forward pass: mark its chunk computed, cache the blocks
        it filled, append its sampled token (`sampled`, for the chunks that sample and generate) and end it
        when it is done. A chunk that samples for a request with `max_tokens=0` ends it ("length")."""
        finished: dict[Sequence, str] = {}
        prompt_tokens = 0
        for c in plan.chunks:
            seq = c.seq
            samples = c.samples
            if seq.num_computed < seq.num_prompt:
                prompt_tokens += min(c.num_tokens, seq.num_prompt - seq.num_computed)
            seq.num_computed += c.num_tokens
            if self.enable_prefix_caching:
                self._cache_blocks(seq)
            if not samples:
                continue
            reason = "length" if seq.params.max_tokens == 0 else None
            token = sampled.get(seq)
            if token is not None:
                seq.tokens.append(token)
                if seq.sampling is not None:
                    seq.sampling.accept(token)  # logits processors and the grammar advance here, and only here
                reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished[seq] = reason
        return StepUpdate(finished, prompt_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.sampling is not None and seq.sampling.finished:  # the grammar is complete
            return "stop"
        if len(seq.tokens) >= seq.max_len:
            return "length"
        return None

    # ------------------------------------------------------------------ prefix cache

    def _looks_up(self, seq: Sequence) -> bool:
        """Whether `seq` may start from cached blocks: caching on, nothing held, no prompt logprobs wanted
        (they need the logits of every prompt position)."""
        return (
            self.enable_prefix_caching
            and seq.num_computed == 0
            and not seq.blocks
            and seq.params.prompt_logprobs is None
        )

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that `seq` can start from (its last token is always computed)."""
        if not self._looks_up(seq):
            return []
        usable = (len(seq.tokens) - 1) // self.kv.block_size
        return self.kv.pool.lookup(self._hashes(seq, usable))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of `seq`'s first `num_blocks` full blocks (computed once, extended as it grows)."""
        bs, hashes = self.kv.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, seq.tokens[i * bs : (i + 1) * bs], seq.cache_key))
        return hashes[:num_blocks]

    def _cache_blocks(self, seq: Sequence) -> None:
        """Cache the blocks of `seq` that are full and computed and not cached yet."""
        full = seq.num_computed // self.kv.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        pool, bs = self.kv.pool, self.kv.block_size
        for i in range(seq.num_cached_blocks, full):
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            pool.cache(seq.blocks[i], hashes[i], hashes[i - 1] if i else None, tokens, seq.adapter)
        seq.num_cached_blocks = full
