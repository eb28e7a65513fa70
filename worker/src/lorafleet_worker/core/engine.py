"""Engine: the async API (`generate`, adapters) over a step loop running in its own thread.

The step loop owns the scheduler, the KV cache and the model: it takes new requests and aborts
from a locked inbox, schedules one step, runs the forward pass and sampling, and hands each
request's tokens to its asyncio queue with `loop.call_soon_threadsafe`. Torch work never runs
on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.batch_builder import build_forward_batch
from lorafleet_worker.core.errors import EngineUnavailableError
from lorafleet_worker.core.kv_cache import PagedKVCache
from lorafleet_worker.core.kv_events import KVEventsConfig, KVEventStream
from lorafleet_worker.core.memory import (
    MemoryBudget,
    MemoryPlan,
    activation_bytes,
    free_device_memory,
    plan_memory,
    weight_bytes,
)
from lorafleet_worker.core.scheduler import Scheduler, SeqStatus, Sequence, StepPlan
from lorafleet_worker.host.devices import resolve_dtype, resolve_lora_backend
from lorafleet_worker.host.omp_threads import on_fresh_thread, serial, size_team
from lorafleet_worker.lora.backend import LoRABackend, get_backend
from lorafleet_worker.lora.errors import AdapterNotFoundError, CapacityError
from lorafleet_worker.lora.manager import AdapterManager
from lorafleet_worker.model import LoRAContext, Transformer, cpu_attention, cpu_linear, parse_dtype
from lorafleet_worker.model.quantization import check_supported as check_quantization
from lorafleet_worker.sample.sampler import (
    SamplingParams,
    SamplingState,
    TokenConstraint,
    TokenOutput,
    prompt_logprobs,
    sample,
)
from lorafleet_worker.structured.masks import GrammarMasks

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # wake-up period while work waits on something other than a new request


@dataclass
class EngineStats:
    """Counters of the step loop (read by metrics and tests; written only by the step thread)."""

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
    running_adapters: tuple[str, ...] = ()  # adapters of the running / waiting requests (vLLM's LoRA info)
    waiting_adapters: tuple[str, ...] = ()
    updated_at: float = 0.0  # wall-clock time of the last update


def _check_device(device: torch.device, lora_backend: str) -> None:
    """Clear errors for a device that is not there and for Triton without CUDA (unless interpreted)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device.type!r}; choose cpu or cuda")
    if lora_backend == "triton" and device.type != "cuda":
        from lorafleet_worker.kernels import interpreting

        if not interpreting():
            raise ValueError("the triton LoRA backend needs --device cuda (or TRITON_INTERPRET=1 for tests)")


def _attention_backend(lora_backend: str, device: torch.device) -> str:
    """The paged decode attention: the Triton kernel goes with the Triton LoRA backend (on CUDA, or
    interpreted in tests); on CPU the C++ loop that reads KV blocks in place where it builds, else torch."""
    if lora_backend == "triton":
        return "triton"
    if device.type == "cpu" and cpu_attention.available():
        return "cpu"
    return "torch"


def _max_model_len(config: ModelConfig, requested: int | None) -> int:
    """`requested`, else the model's max_position_embeddings; above it is an error (as in vLLM)."""
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} is larger than the model's max_position_embeddings ({limit}, "
            "config.json): positions beyond it were never trained; lower --max-model-len"
        )
    return requested


class _Request:
    """The event-loop side of one request: its output queue and completion event."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.queue: asyncio.Queue[TokenOutput | BaseException] = asyncio.Queue()
        self.done = asyncio.Event()


class Engine:
    # every torch op of the setup runs on a thread that ends with it, so that its OpenMP pool does not outlive
    # it and throttle the step loop's (omp_threads.py)
    @on_fresh_thread
    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_loras: int = 8,
        max_cpu_loras: int = 64,
        max_lora_rank: int = 64,
        max_adapters: int | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        lora_backend: str = "auto",
        memory_budget: str | float | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        slot_aging_s: float = 1.0,
        enable_prefix_caching: bool = True,
        kv_events: KVEventsConfig | None = None,
        quantization: str | None = None,
    ) -> None:
        """`dtype` / `lora_backend` "auto": see devices.py; `memory_budget` (a fraction or a size, see
        memory.py) sizes the KV cache unless `num_kv_blocks` is given; `enable_prefix_caching`: see scheduler.py;
        `kv_events`: publish the prefix cache's KV events (kv_events.py); `quantization`: weight-only int8 /
        int4 base linears (model/quantization.py), counted as such by the memory plan."""
        size_team()
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.device = torch.device(device)
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        self.max_model_len = _max_model_len(self.config, max_model_len)
        budget = MemoryBudget.parse(memory_budget) if memory_budget is not None else MemoryBudget()
        _check_device(self.device, lora_backend)
        dtype_name, why_dtype = resolve_dtype(dtype, self.config.torch_dtype, self.device)
        backend_name, why_backend = resolve_lora_backend(lora_backend, self.device)
        self.dtype = parse_dtype(dtype_name)
        if quantization is not None:
            check_quantization(quantization, self.device, self.dtype)
        self.quantization = quantization
        log.info("dtype %s: %s; LoRA backend %s: %s", dtype_name, why_dtype, backend_name, why_backend)
        self.lora_backend_name = backend_name
        max_num_batched_tokens = max_num_batched_tokens or max(2048, max_num_seqs)
        free_at_start = free_device_memory(self.device)  # CUDA: before the LoRA slots and weights take theirs
        self.max_loras = max_loras
        self.manager: AdapterManager | None = None
        self.lora_backend: LoRABackend | None = None
        if max_loras > 0:  # the slot pool is allocated before the KV cache takes what is left
            self.manager = AdapterManager(
                self.config,
                max_loras=max_loras,
                max_cpu_loras=max_cpu_loras,
                max_lora_rank=max_lora_rank,
                max_adapters=max_adapters,
                device=self.device,
                dtype=self.dtype,
                rank_major_b=backend_name == "torch" and self.device.type == "cpu",  # Triton reads out-major B
            )
            self.lora_backend = get_backend(backend_name, self.device)
            self.manager.on_weights_ready = self._wake
        if num_kv_blocks is None:
            self.memory_plan: MemoryPlan | None = self._plan_memory(
                budget, free_at_start, block_size, max_num_seqs, max_num_batched_tokens
            )
            num_kv_blocks = self.memory_plan.kv_blocks
            log.info(self.memory_plan.describe(self.max_model_len))
        else:
            self.memory_plan = None
            if -(-self.max_model_len // block_size) > num_kv_blocks:
                raise ValueError(
                    f"num_kv_blocks={num_kv_blocks} x block_size={block_size} cannot hold one sequence of "
                    f"max_model_len={self.max_model_len}"
                )
        attn_backend = _attention_backend(backend_name, self.device)
        log.info("decode attention: %s", attn_backend)
        self.model = Transformer.from_pretrained(
            self.model_dir, device=self.device, dtype=self.dtype, config=self.config, attn_backend=attn_backend
        )
        if quantization is not None:
            n = self.model.quantize_weights(quantization)
            log.info("quantized %d base weights to %s", n, quantization)
        self.kv = PagedKVCache(
            self.config, num_blocks=num_kv_blocks, block_size=block_size, device=self.device, dtype=self.dtype
        )
        self.scheduler = Scheduler(
            self.kv,
            self.manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_loras=max_loras,
            slot_aging_s=slot_aging_s,
            enable_prefix_caching=enable_prefix_caching,
            eos_token_ids=self.config.eos_token_ids,
        )
        self.stats = EngineStats(kv_blocks_total=num_kv_blocks, kv_blocks_free=num_kv_blocks)
        self._kv_events = KVEventStream(kv_events, block_size) if kv_events is not None and kv_events.active else None
        if self._kv_events is not None:
            self.kv.pool.on_event = self._kv_events.record
        self.grammar_masks = GrammarMasks(self.config.vocab_size)  # structured output's masks, beside the forward
        self._requests: dict[str, _Request] = {}  # event-loop thread only
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.died: str | None = None  # why the step loop ended by an error (it is not restarted)
        self.progress_at = time.monotonic()  # last step, or last moment with nothing to do (read by /health)

    def _plan_memory(
        self, budget: MemoryBudget, free: int | None, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> MemoryPlan:
        """Share the memory budget out between weights, LoRA slots, activations and KV blocks (memory.py)."""
        budget_bytes, budget_source = budget.resolve(self.device)
        return plan_memory(
            budget=budget_bytes,
            budget_source=budget_source,
            weights=weight_bytes(
                self.config,
                self.dtype,
                packed_head_copy=self.device.type == "cpu" and cpu_linear.packs(self.dtype),
                quantization=self.quantization,
                layouts=cpu_linear.layouts(self.dtype) if self.device.type == "cpu" else 1,  # quantized: unused
            ),
            lora=self.manager.pool.nbytes if self.manager is not None else 0,
            activations=activation_bytes(
                self.config, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, dtype=self.dtype
            ),
            bytes_per_block=PagedKVCache.bytes_per_block(self.config, block_size, self.dtype),
            block_size=block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            free=free,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        return self.died is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet ended (event-loop thread)."""
        return len(self._requests)

    async def start(self) -> None:
        """Start the step loop (idempotent)."""
        if self.running:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lorafleet-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the step loop; requests still in flight end with finish_reason "abort"."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        *,
        constraint: TokenConstraint | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Submit a request and return its token stream; `constraint`: the grammar its output follows
        (structured/masks.py, one per request).

        Raises before yielding: ValueError (bad params / prompt), AdapterNotFoundError (unknown adapter
        or being removed), EngineUnavailableError (the step loop is not running); the iterator raises
        EngineUnavailableError if the step loop dies meanwhile. Closing the iterator aborts the request.
        """
        if not self.running:
            raise EngineUnavailableError(self.died or "the engine is not running")
        params.validate()
        if constraint is not None and params.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output (the grammar decides the end)")
        self._check_prompt(prompt_token_ids)
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        ref = None
        if adapter is not None:
            if self.manager is None:
                raise AdapterNotFoundError(f"adapter {adapter!r} not found (LoRA is disabled: max_loras=0)")
            ref = self.manager.acquire(adapter)
        max_len = min(self.max_model_len, len(prompt_token_ids) + params.max_tokens)
        seq = Sequence(
            request_id=request_id,
            tokens=list(prompt_token_ids),
            num_prompt=len(prompt_token_ids),
            params=params,
            max_len=max_len,
            adapter=adapter,
            ref=ref,
            sampling=SamplingState.create(
                params,
                prompt_token_ids,
                eos_token_ids=self.config.eos_token_ids,
                device=self.device,
                constraint=constraint,
            ),
        )
        req = _Request(seq)
        if not self._requests:  # work starts now: a stall is measured from here
            self.progress_at = time.monotonic()
        self._requests[request_id] = req
        with self._cond:
            self._inbox.append(seq)
            self._cond.notify()
        return self._stream(req)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is {self.max_model_len}"
            )
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    async def _stream(self, req: _Request) -> AsyncIterator[TokenOutput]:
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not req.done.is_set():
                self.abort(req.seq.request_id)

    def interrupt(self, request_id: str, exc: BaseException) -> None:
        """Event-loop side: the request's token stream raises `exc` at its next read, after the outputs already
        queued (closing the stream then aborts the request); no-op if the request already ended. How a client
        disconnect reaches a stream that waits for its next token, without a second waiter per token."""
        req = self._requests.get(request_id)
        if req is not None:
            req.queue.put_nowait(exc)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended); its blocks and adapter pin are freed by the step loop."""
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify()

    # ------------------------------------------------------------------ adapters

    def _wake(self) -> None:
        """Wake the step loop (e.g. adapter weights it waited for are in memory now)."""
        with self._cond:
            self._cond.notify()

    def _require_manager(self) -> AdapterManager:
        if self.manager is None:
            raise CapacityError("LoRA is disabled on this worker (max_loras=0)")
        return self.manager

    async def add_adapter(self, name: str, path: Path, *, replace: bool = False) -> None:
        """Validate and load an adapter into the CPU tier (in a worker thread, its torch ops serial there:
        omp_threads.py)."""
        manager = self._require_manager()
        await asyncio.to_thread(serial(manager.load), name, Path(path), replace=replace)

    async def remove_adapter(self, name: str) -> bool:
        """Refuse new requests for `name` at once; return after its in-flight requests finished.

        False if no adapter of that name was registered.
        """
        if self.manager is None:
            return False
        pending = [r.done for r in self._requests.values() if r.seq.adapter == name]
        try:
            self.manager.remove(name)
        except AdapterNotFoundError:
            return False
        for done in pending:
            await done.wait()
        return True

    def adapters(self) -> list[str]:
        return [] if self.manager is None else list(self.manager.names())

    # ------------------------------------------------------------------ step loop (engine thread)

    def _run(self) -> None:
        """The step loop's thread: steps until stopped. An error that escapes the loop (a step's
        BaseException, a scheduler bug outside a step) ends it for good: every request in flight then
        fails with EngineUnavailableError, as do new ones, and /health fails so the kubelet restarts us."""
        try:
            self._step_loop()
        except BaseException as exc:  # the thread ends either way; its requests must not hang
            log.critical("the engine loop died", exc_info=True)
            self._die(f"the engine loop died: {type(exc).__name__}: {exc}")
            return
        self._shutdown()

    def _die(self, why: str) -> None:
        """Refuse new requests from now on (`generate` reads `died`), then fail those in flight on the loop."""
        self.died = why
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is listening
                self._loop.call_soon_threadsafe(self._fail_in_flight, why)

    def _fail_in_flight(self, why: str) -> None:
        """Event-loop side: every request not ended yet raises EngineUnavailableError."""
        self._dispatch([(rid, EngineUnavailableError(why)) for rid in list(self._requests)])

    def _step_loop(self) -> None:
        if self.device.type == "cpu":
            # Flush denormals to zero (FTZ/DAZ) in this thread and in the OpenMP workers it starts (they inherit
            # its MXCSR): adapters that push activations to tiny values made the real model's decode steps up to
            # 1.4x slower on denormal arithmetic (bench/README.md, the CPU LoRA path).
            torch.set_flush_denormal(True)
        sched = self.scheduler
        while True:
            with self._cond:
                if not (self._stopping or self._inbox or self._aborts or sched.has_work()):
                    self._cond.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for seq in inbox:
                sched.add(seq)
            if aborts:
                self._apply_aborts(aborts)
            if not sched.has_work():
                self.progress_at = time.monotonic()
                continue
            try:
                plan = sched.schedule()
            except Exception as exc:  # a scheduling bug must not hang every request
                log.exception("engine scheduling failed")
                self._fail([*sched.running, *sched.waiting], exc)
                continue
            failed = sched.take_failed()
            if failed:
                self._deliver([(seq.request_id, exc) for seq, exc in failed])
            if not plan.chunks:
                self._update_queue_stats()
                with self._cond:
                    if not (self._stopping or self._inbox or self._aborts):
                        self._cond.wait(IDLE_POLL_S)
                continue
            try:
                self._step(plan)
            except Exception as exc:  # a failing step ends its requests, never the engine
                log.exception("engine step failed")
                self._fail([c.seq for c in plan.chunks], exc)
            if self._kv_events is not None:
                self._kv_events.flush()
            self.progress_at = time.monotonic()

    def _step(self, plan: StepPlan) -> None:
        samplers = [c for c in plan.chunks if c.samples]
        keep = [i for i, c in enumerate(samplers) if c.seq.params.max_tokens > 0]
        prefill_only = [c.seq for c in samplers if c.seq.params.max_tokens == 0]
        sampled_chunks = [samplers[i] for i in keep]
        states = [c.seq.sampling or SamplingState(c.seq.params) for c in sampled_chunks]
        masks = self.grammar_masks.start(states)  # in a background thread, while the forward pass runs
        batch, token_slots = build_forward_batch(plan, self.kv.block_size, self.device)
        backend, manager = self.lora_backend, self.manager
        if backend is not None and manager is not None and bool((token_slots >= 0).any()):
            info = backend.prepare(token_slots.to(self.device, non_blocking=True))
            batch.lora = LoRAContext(backend, manager.pool, info)
        logits = self._score_prompts(plan, self.model(batch, self.kv))
        if prefill_only:
            logits = logits[keep]
        picks = sample(logits, states, masks.wait(logits.device))
        seqs = [c.seq for c in sampled_chunks]
        update = self.scheduler.update(plan, {s: pick.token_id for s, pick in zip(seqs, picks, strict=True)})
        st = self.stats
        st.steps += 1
        st.max_adapters_in_step = max(st.max_adapters_in_step, len(plan.slots))
        st.max_seqs_in_step = max(st.max_seqs_in_step, len(plan.chunks))
        st.prompt_tokens += update.prompt_tokens
        st.requests_finished += len(update.finished)
        st.generation_tokens += len(seqs)
        out: list[tuple[str, TokenOutput | BaseException]] = []
        for seq in prefill_only:  # max_tokens=0: the prompt is scored, nothing is generated
            out.append((seq.request_id, TokenOutput(-1, 0.0, None, "length", self._prompt_logprobs_of(seq))))
        for seq, pick in zip(seqs, picks, strict=True):
            token = TokenOutput(pick.token_id, pick.logprob, pick.top_logprobs, update.finished.get(seq))
            if seq.num_output == 1:
                token.prompt_logprobs = self._prompt_logprobs_of(seq)
            out.append((seq.request_id, token))
        self._update_queue_stats()
        self._deliver(out)

    @staticmethod
    def _score_prompts(plan: StepPlan, logits: Tensor) -> Tensor:
        """Record prompt logprobs from their rows of `logits`; return the rows that sample."""
        if not any(c.prompt_logprob_positions for c in plan.chunks):
            return logits
        row, sample_rows = 0, []
        for c in plan.chunks:
            positions = c.prompt_logprob_positions
            if positions:
                seq = c.seq
                targets = [seq.tokens[p + 1] for p in positions]
                k = seq.params.prompt_logprobs or 0
                seq.prompt_logprobs.extend(prompt_logprobs(logits[row : row + len(positions)], targets, k))
                row += len(positions)
            if c.samples:
                sample_rows.append(row)
                row += 1
        return logits[sample_rows]

    @staticmethod
    def _prompt_logprobs_of(seq: Sequence) -> list[tuple[float, dict[int, float]]] | None:
        return None if seq.params.prompt_logprobs is None else list(seq.prompt_logprobs)

    def _apply_aborts(self, request_ids: set[str]) -> None:
        live = {s.request_id: s for s in [*self.scheduler.running, *self.scheduler.waiting]}
        out: list[tuple[str, TokenOutput | BaseException]] = []
        for rid in request_ids:
            seq = live.get(rid)
            if seq is None:
                continue
            self.scheduler.finish(seq, "abort")
            self.stats.requests_aborted += 1
            out.append((rid, TokenOutput(-1, 0.0, None, "abort")))
        self._update_queue_stats()
        self._deliver(out)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        """End `seqs` with an error that their iterators raise."""
        out: list[tuple[str, TokenOutput | BaseException]] = []
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
                out.append((seq.request_id, RuntimeError(f"engine step failed: {exc}")))
        self._update_queue_stats()
        self._deliver(out)

    def _shutdown(self) -> None:
        sched = self.scheduler
        live = [*sched.running, *sched.waiting]
        for seq in live:
            sched.finish(seq, "abort")
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            if seq.ref is not None and self.manager is not None:
                self.manager.release(seq.ref)
        self._deliver([(s.request_id, TokenOutput(-1, 0.0, None, "abort")) for s in [*live, *inbox]])
        self._update_queue_stats()
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None
        self.grammar_masks.close()

    def _update_queue_stats(self) -> None:
        st, sched = self.stats, self.scheduler
        st.num_running = len(sched.running)
        st.num_waiting = len(sched.waiting)
        st.num_waiting_for_slot = sched.num_waiting_for_slot
        st.preemptions = sched.num_preemptions
        st.kv_blocks_free = sched.num_free_blocks
        st.prefix_cache_queries = sched.prefix_cache_queries
        st.prefix_cache_hits = sched.prefix_cache_hits
        st.running_adapters = tuple(dict.fromkeys(s.adapter for s in sched.running if s.adapter))
        st.waiting_adapters = tuple(dict.fromkeys(s.adapter for s in sched.waiting if s.adapter))
        st.updated_at = time.time()

    def _deliver(self, items: list[tuple[str, TokenOutput | BaseException]]) -> None:
        if items and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is listening
                self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[tuple[str, TokenOutput | BaseException]]) -> None:
        """Event-loop side: put each output in its request's queue; final items complete the request."""
        for rid, item in items:
            req = self._requests.get(rid)
            if req is None:
                continue
            req.queue.put_nowait(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                req.done.set()
                del self._requests[rid]
