"""Continuous batching: the one owner of live requests (by id), which of their tokens run in the next step,
and what happens to them after it.

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

Drafts: a running sequence whose chunk reaches its end may verify draft tokens after its last one in the
same forward pass: its grammar's forced tokens (jump-forward), else an n-gram draft (speculative decoding,
spec_decode/; no drafts while more than `disable_by_batch_size` requests run). The model runner keeps the
accepted prefix and one more token (sample/rejection.py); the KV of rejected positions lies beyond
`num_computed` and is overwritten later.

KV blocks and the prefix cache are the KV cache manager's (kv_cache_manager.py); grammars are the
structured-output manager's. `update_from_output` alone moves sequences on after a step (computed
tokens, cached blocks, sampled tokens, finish reasons) and turns the step into each request's output;
`finish_requests` ends requests from outside (aborts, failures, shutdown). The scheduler counts what it
does and publishes a snapshot of its counters (`stats`) after every change.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from lorafleet_worker.core.kv_cache_manager import KVCacheManager
from lorafleet_worker.core.request import SeqStatus, Sequence
from lorafleet_worker.core.step import RunnerOutput, ScheduledChunk, StepPlan
from lorafleet_worker.lora.manager import AdapterManager
from lorafleet_worker.sample.params import PromptLogprob, SampledToken, TokenOutput
from lorafleet_worker.spec_decode.config import SpeculativeConfig
from lorafleet_worker.spec_decode.ngram import NgramProposer
from lorafleet_worker.structured.manager import StructuredOutputManager

Output = tuple[str, TokenOutput | BaseException]  # a request id and its next output (or why it failed)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's counters and queues (published by the step thread, read by metrics)."""

    steps: int = 0
    max_adapters_in_step: int = 0  # never above max_loras
    max_seqs_in_step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_slot: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # cached blocks that no request holds count as free (vLLM's meaning)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    spec_drafts: int = 0  # speculative decoding: drafts verified, their tokens, and those accepted
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted draft tokens by position (empty: speculation off)
    running_adapters: tuple[str, ...] = ()  # adapters of the running / waiting requests (vLLM's LoRA info)
    waiting_adapters: tuple[str, ...] = ()
    updated_at: float = 0.0  # wall-clock time of the snapshot


class Scheduler:
    """Owns the live requests (waiting queue, running set), their admission, preemption and ending."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        manager: AdapterManager | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        structured: StructuredOutputManager | None = None,
        slot_aging_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        eos_token_ids: Collection[int] = (),
        speculative: SpeculativeConfig | None = None,
        jump_forward: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        self.manager = manager
        self.structured = structured
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slot_aging_s = slot_aging_s
        self.clock = clock
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.watermark_blocks = max(1, kv_cache.num_blocks // 100)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._failed: list[Output] = []  # sequences that could not start (`take_failed`)
        self.speculative = speculative
        self.proposer: NgramProposer | None = None
        if speculative is not None:
            cfg = speculative
            self.proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens)
        self.jump_forward = jump_forward and structured is not None
        # counters (published in `stats`)
        self.num_preemptions = 0
        self._steps = 0
        self._max_adapters_in_step = 0
        self._max_seqs_in_step = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._requests_finished = 0
        self._requests_aborted = 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_per_pos = [0] * (speculative.num_speculative_tokens if speculative is not None else 0)
        self.stats = SchedulerStats()
        self._publish()

    # ------------------------------------------------------------------ requests

    def add_request(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if seq.grammar is not None:
            if self.structured is None:
                raise ValueError("structured output needs the scheduler's structured-output manager")
            self.structured.add_request(seq.request_id, seq.grammar)
        seq.status = SeqStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        self._publish()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_for_slot(self) -> int:
        return sum(1 for s in self.waiting if s.slot_wait_since is not None)

    def take_failed(self) -> list[Output]:
        """The requests that could not start since the last call, with why (already ended)."""
        failed, self._failed = self._failed, []
        return failed

    def finish_requests(self, request_ids: Iterable[str], reason: str = "abort") -> list[Output]:
        """End live requests from outside the step (an abort, shutdown); the final output of each."""
        out: list[Output] = []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is None:
                continue
            self._finish(seq, reason)
            if reason == "abort":
                self._requests_aborted += 1
            out.append((rid, TokenOutput(-1, 0.0, None, reason)))
        self.kv_cache.flush_events()
        self._publish()
        return out

    def fail_requests(self, request_ids: Iterable[str], exc: Exception) -> list[Output]:
        """End live requests whose step failed; each stream raises the error."""
        out: list[Output] = []
        for rid in list(request_ids):
            seq = self.requests.get(rid)
            if seq is not None:
                self._finish(seq, "abort")
                out.append((rid, RuntimeError(f"engine step failed: {exc}")))
        self.kv_cache.flush_events()
        self._publish()
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`: leave the queues, free its blocks, its grammar and its adapter ref. Idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        del self.requests[seq.request_id]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv_cache.remove(seq)
        if self.structured is not None:
            self.structured.remove_request(seq.request_id)
        if seq.ref is not None and self.manager is not None:
            self.manager.release(seq.ref)
            seq.ref = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
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
        spec = self.speculative
        speculate = spec is not None and len(self.running) <= spec.disable_by_batch_size  # back-off under load
        for seq in sorted(self.running, key=lambda s: s.arrival):  # oldest first: they are preempted last
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted by an older sequence this step
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._reserve(seq, n, scheduled):
                continue
            chunk = ScheduledChunk(seq, n)
            if seq.num_computed + n == len(seq.tokens):  # it samples: draft tokens may follow its last token
                chunk.draft, chunk.forced = self._draft(seq, budget - n, speculate)
                chunk.num_tokens += len(chunk.draft)
            chunks.append(chunk)
            scheduled.add(id(seq))
            budget -= chunk.num_tokens
        if self.num_preemptions == preemptions:  # memory is short when running sequences were preempted
            self._admit(chunks, budget)
        # decode tokens first, grouped by LoRA slot: each adapter's decodes are then consecutive rows,
        # which the LoRA backends update in place (no gather/scatter); prefill chunks keep their order
        chunks.sort(key=lambda c: (c.num_tokens != 1, c.seq.slot if c.num_tokens == 1 else 0))
        for c in chunks:
            c.blocks = self.kv_cache.block_ids(c.seq)
        plan = StepPlan(chunks, sum(1 for c in chunks if c.num_tokens == 1), self.kv_cache.take_new_blocks())
        if not chunks:
            self._publish()
        return plan

    def _draft(self, seq: Sequence, budget: int, speculate: bool) -> tuple[list[int], bool]:
        """The tokens to verify after `seq`'s last one this step, and whether the grammar forces them: its
        grammar's only continuation (jump-forward), else an n-gram draft the grammar accepts (speculation on
        this step); within the token budget, the sequence's length limit and its KV blocks (never preempting
        for a draft). A request with logits processors gets none (they advance token by token)."""
        room = min(budget, seq.max_len - len(seq.tokens) - 1)
        if room <= 0 or seq.sampling.processors or seq.params.max_tokens == 0:
            return [], False
        draft, forced = [], False
        if self.jump_forward:
            assert self.structured is not None
            draft = self.structured.forced_tokens(seq.request_id)[:room]
            forced = bool(draft)
        if not draft and speculate:
            assert self.proposer is not None
            draft = self.proposer.propose(seq.tokens, room)
            if draft and self.structured is not None:
                draft = self.structured.valid_prefix(seq.request_id, draft)
        if draft and not self.kv_cache.allocate(seq, len(seq.tokens) + len(draft)):
            return [], False
        return draft, forced

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Grow `seq`'s blocks for `n` more tokens, preempting the newest unscheduled sequences if needed."""
        while not self.kv_cache.allocate(seq, seq.num_computed + n):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(max(victims, key=lambda s: s.arrival))
        return True

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        now = self.clock()
        kv = self.kv_cache
        slots_blocked = False  # an aged sequence waits for a slot: admit no new slot users
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            needs_slot = seq.ref is not None and seq.slot < 0  # a preempted sequence keeps its slot
            if needs_slot and slots_blocked:
                seq.slot_wait_since = seq.slot_wait_since if seq.slot_wait_since is not None else now
                continue
            hits = kv.lookup(seq)
            computed = seq.num_computed + len(hits) * kv.block_size
            n = min(len(seq.tokens) - computed, budget)
            # keep a few blocks for the decodes of running sequences (fewer preemptions), unless idle
            reserve = self.watermark_blocks if self.running else 0
            if kv.num_blocks_needed(seq, hits, computed + n) > kv.num_free_blocks - reserve:
                break  # FIFO on memory: later sequences do not overtake one that does not fit
            if seq.ref is not None:
                assert self.manager is not None, "a sequence with an adapter ref needs the adapter manager"
                try:
                    if needs_slot and not self.manager.weights_ready(seq.ref):
                        continue  # read back from disk off this thread; the others keep running
                    slot = seq.slot if seq.slot >= 0 else self.manager.activate(seq.ref)
                except Exception as exc:  # e.g. the adapter's files vanished before a reload
                    self._finish(seq, "abort")
                    self._failed.append((seq.request_id, exc))
                    continue
                if slot is None:  # every slot pinned (the adapter manager holds `max_loras` of them)
                    seq.slot_wait_since = seq.slot_wait_since if seq.slot_wait_since is not None else now
                    if now - seq.slot_wait_since >= self.slot_aging_s:
                        slots_blocked = True
                    continue
                seq.slot_wait_since = None
            kv.admit(seq, hits, computed + n)
            seq.num_computed = computed
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n

    # ------------------------------------------------------------------ after a step

    def update_from_output(self, plan: StepPlan, output: RunnerOutput) -> list[Output]:
        """Move every sequence of `plan` on after its forward pass: mark its chunk computed, record its prompt
        logprobs, append the tokens it kept (its sampled token, or its accepted draft tokens and the token drawn
        after them; advancing its logits processors and grammar over each), cache the blocks it filled (of kept
        tokens only: the KV of rejected draft tokens lies beyond `num_computed` and is overwritten later) and
        end it when it is done. A chunk that samples for a request with `max_tokens=0` ends it ("length").
        Returns each request's outputs of the step, one per token, in order."""
        out: list[Output] = []
        for c in plan.chunks:
            seq, samples, generates = c.seq, c.samples, c.generates  # before the chunk counts as computed
            if seq.num_computed < seq.num_prompt:
                self._prompt_tokens += min(c.num_tokens, seq.num_prompt - seq.num_computed)
            scored = output.prompt_logprobs.get(seq.request_id)
            if scored:
                seq.prompt_logprobs.extend(scored)
            if not generates:
                seq.num_computed += c.num_tokens
                self.kv_cache.cache_blocks(seq)
                if samples:  # max_tokens=0: the prompt is scored, nothing is generated
                    self._finish(seq, "length")
                    self._requests_finished += 1
                    out.append((seq.request_id, TokenOutput(-1, 0.0, None, "length", self._prompt_logprobs_of(seq))))
                continue
            picks = output.verified[seq.request_id] if c.draft else [output.sampled[seq.request_id]]
            accepted = len(picks) - 1
            if c.draft and not c.forced:
                self._count_draft(len(c.draft), accepted)
            seq.num_computed += c.num_tokens - (len(c.draft) - accepted)  # the KV of rejected draft tokens is dropped
            reason = None
            for pick in picks:
                reason = self._append(seq, pick, out)
                if reason is not None:
                    break
            seq.num_computed = min(seq.num_computed, len(seq.tokens))  # it ended on an accepted draft token
            self.kv_cache.cache_blocks(seq)
            if reason is not None:
                self._finish(seq, reason)
                self._requests_finished += 1
        self._steps += 1
        self._max_adapters_in_step = max(self._max_adapters_in_step, len(plan.slots))
        self._max_seqs_in_step = max(self._max_seqs_in_step, len(plan.chunks))
        self.kv_cache.flush_events()
        self._publish()
        return out

    def _append(self, seq: Sequence, pick: SampledToken, out: list[Output]) -> str | None:
        """Append one kept token to `seq` (its processors and grammar advance over it) and its output to `out`;
        the finish reason it gives, if any."""
        self._generation_tokens += 1
        token = pick.token_id
        seq.tokens.append(token)
        seq.sampling.accept(token)  # logits processors advance here, and only here
        if self.structured is not None:
            self.structured.accept(seq.request_id, token)  # so does the grammar
        reason = self._finish_reason(seq, token)
        result = TokenOutput(token, pick.logprob, pick.top_logprobs, reason)
        if seq.num_output == 1:
            result.prompt_logprobs = self._prompt_logprobs_of(seq)
        out.append((seq.request_id, result))
        return reason

    def _count_draft(self, num_draft: int, num_accepted: int) -> None:
        self._spec_drafts += 1
        self._spec_draft_tokens += num_draft
        for j in range(num_accepted):
            self._spec_accepted_per_pos[j] += 1

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if self.structured is not None and self.structured.finished(seq.request_id):  # the grammar is complete
            return "stop"
        if len(seq.tokens) >= seq.max_len:
            return "length"
        return None

    @staticmethod
    def _prompt_logprobs_of(seq: Sequence) -> list[PromptLogprob] | None:
        return None if seq.params.prompt_logprobs is None else list(seq.prompt_logprobs)

    # ------------------------------------------------------------------ stats

    def _publish(self) -> None:
        """Replace `stats` with a snapshot of now (read by other threads, written only here)."""
        kv = self.kv_cache
        self.stats = SchedulerStats(
            steps=self._steps,
            max_adapters_in_step=self._max_adapters_in_step,
            max_seqs_in_step=self._max_seqs_in_step,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_slot=self.num_waiting_for_slot,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            requests_finished=self._requests_finished,
            requests_aborted=self._requests_aborted,
            preemptions=self.num_preemptions,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            spec_drafts=self._spec_drafts,
            spec_draft_tokens=self._spec_draft_tokens,
            spec_accepted_tokens=sum(self._spec_accepted_per_pos),
            spec_accepted_per_pos=tuple(self._spec_accepted_per_pos),
            running_adapters=tuple(dict.fromkeys(s.adapter for s in self.running if s.adapter)),
            waiting_adapters=tuple(dict.fromkeys(s.adapter for s in self.waiting if s.adapter)),
            updated_at=time.time(),
        )
