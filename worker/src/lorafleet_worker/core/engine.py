"""Engine: the bridge between the asyncio side (`generate`, `abort`, adapters) and the step loop, which runs
in its own thread.

The step loop takes new requests and aborts from a locked inbox, hands them to the scheduler, has it
schedule one step, runs the step (engine_core.py: the model runner, then the scheduler's update) and
hands each request's outputs to its asyncio queue with `loop.call_soon_threadsafe`. Torch work never runs
on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.engine_core import EngineCore
from lorafleet_worker.core.errors import EngineUnavailableError
from lorafleet_worker.core.request import Sequence
from lorafleet_worker.core.scheduler import Output, SchedulerStats
from lorafleet_worker.core.step import StepPlan
from lorafleet_worker.host.omp_threads import on_fresh_thread, serial, size_team
from lorafleet_worker.lora.errors import AdapterNotFoundError, CapacityError
from lorafleet_worker.lora.manager import AdapterManager
from lorafleet_worker.sample.params import SamplingParams, TokenOutput
from lorafleet_worker.structured.grammar import CompiledGrammar, Constraint

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # wake-up period while work waits on something other than a new request


class _Request:
    """The event-loop side of one request: its output queue and completion event."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.queue: asyncio.Queue[TokenOutput | BaseException] = asyncio.Queue()
        self.done = asyncio.Event()


class Engine:
    """The engine's asyncio face: requests in, token streams out, adapters loaded and removed; the parts it
    steps are `core` (engine_core.EngineCore), touched only by the step loop's thread."""

    # every torch op of the setup runs on a thread that ends with it, so that its OpenMP pool does not outlive
    # it and throttle the step loop's (omp_threads.py)
    @on_fresh_thread
    def __init__(self, model_dir: Path, **settings: Any) -> None:
        """`settings`: the parts' settings (engine_core.EngineCore)."""
        size_team()
        self.core = EngineCore(model_dir, **settings)
        self.config: ModelConfig = self.core.config
        self.device: torch.device = self.core.device
        self.max_model_len: int = self.core.max_model_len
        self.manager: AdapterManager | None = self.core.manager
        if self.manager is not None:
            self.manager.on_weights_ready = self._wake
        self._requests: dict[str, _Request] = {}  # event-loop thread only
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.died: str | None = None  # why the step loop ended by an error (it is not restarted)
        self.progress_at = time.monotonic()  # last step, or last moment with nothing to do (read by /health)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's latest snapshot of its counters (any thread)."""
        return self.core.scheduler.stats

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile a structured-output constraint (cached; blocks: call it off the event loop)."""
        return self.core.structured.compile(constraint)

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
        grammar: CompiledGrammar | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Submit a request and return its token stream; `grammar`: the compiled constraint its output
        follows (structured output, `compile`).

        Raises before yielding: ValueError (bad params / prompt), AdapterNotFoundError (unknown adapter
        or being removed), EngineUnavailableError (the step loop is not running); the iterator raises
        EngineUnavailableError if the step loop dies meanwhile. Closing the iterator aborts the request.
        """
        if not self.running:
            raise EngineUnavailableError(self.died or "the engine is not running")
        params.validate()
        if grammar is not None and params.ignore_eos:
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
        seq = Sequence.create(
            request_id,
            prompt_token_ids,
            params,
            max_len=max_len,
            eos_token_ids=self.config.eos_token_ids,
            adapter=adapter,
            ref=ref,
            grammar=grammar,
            device=self.device,
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

    async def add_adapter(self, name: str, path: Path, *, replace: bool = False, source: str | None = None) -> None:
        """Validate and load an adapter into the CPU tier (in a worker thread, its torch ops serial there:
        omp_threads.py); `source`: where it came from (`AdapterManager.sources`)."""
        manager = self._require_manager()
        await asyncio.to_thread(serial(manager.load), name, Path(path), replace=replace, source=source)

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
            # its MXCSR): adapters that push activations to tiny values made the real model's decode steps
            # markedly slower on denormal arithmetic.
            torch.set_flush_denormal(True)
        sched = self.core.scheduler
        while True:
            with self._cond:
                if not (self._stopping or self._inbox or self._aborts or sched.has_work()):
                    self._cond.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for seq in inbox:
                sched.add_request(seq)
            if aborts:
                self._deliver(sched.finish_requests(aborts, "abort"))
            if not sched.has_work():
                self.progress_at = time.monotonic()
                continue
            try:
                plan = sched.schedule()
            except Exception as exc:  # a scheduling bug must not hang every request
                log.exception("engine scheduling failed")
                self._deliver(sched.fail_requests(list(sched.requests), exc))
                continue
            self._deliver(sched.take_failed())
            if not plan.chunks:
                with self._cond:
                    if not (self._stopping or self._inbox or self._aborts):
                        self._cond.wait(IDLE_POLL_S)
                continue
            try:
                self._step(plan)
            except Exception as exc:  # a failing step ends its requests, never the engine
                log.exception("engine step failed")
                self._deliver(sched.fail_requests([c.seq.request_id for c in plan.chunks], exc))
            self.progress_at = time.monotonic()

    def _step(self, plan: StepPlan) -> None:
        """Run one scheduled step and deliver its outputs."""
        self._deliver(self.core.step(plan))

    def _shutdown(self) -> None:
        """End every request still live (the inbox's too: the scheduler releases what they hold)."""
        sched = self.core.scheduler
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            sched.add_request(seq)
        self._deliver(sched.finish_requests(list(sched.requests), "abort"))
        self.core.close()

    def _deliver(self, items: list[Output]) -> None:
        if items and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is listening
                self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[Output]) -> None:
        """Event-loop side: put each output in its request's queue; final items complete the request."""
        for rid, item in items:
            req = self._requests.get(rid)
            if req is None:
                continue
            req.queue.put_nowait(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                req.done.set()
                del self._requests[rid]
