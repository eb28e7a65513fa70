"""The worker's shared state behind both HTTP servers: engine, tokenizer, adapter registry, admin token."""

from __future__ import annotations

import asyncio
import hmac
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from lorafleet_sync.errors import SourceError
from lorafleet_sync.ids import lora_id

from lorafleet_worker.api.protocol import APIError, check_lora_name
from lorafleet_worker.host import huge_pages
from lorafleet_worker.metrics import WorkerMetrics
from lorafleet_worker.settings import WorkerSettings
from lorafleet_worker.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lorafleet_sync.sources import AdapterSources

    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.lora.manager import AdapterManager
    from lorafleet_worker.sample.params import SamplingParams, TokenOutput
    from lorafleet_worker.structured.grammar import CompiledGrammar, Constraint

log = logging.getLogger(__name__)

__all__ = ["KeyedLocks", "LoadResult", "WorkerService", "WorkerSettings", "path_to_uri"]


class KeyedLocks:
    """One asyncio lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks[key] if key in self._locks else (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


@dataclass
class LoadResult:
    lora_name: str
    lora_id: int
    message: str


class WorkerService:
    """Owns the engine that both APIs share, and loads, swaps and unloads adapters into it: fetched from their
    source URI, registered with the engine's adapter manager (the one registry of adapters and their URIs).

    Loads, swaps and unloads of one name are serialized by a per-name lock; different names
    proceed concurrently.
    """

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.model_name = settings.served_model_name
        self._engine: Engine | None = None
        self._tokenizer: Tokenizer | None = None
        self._sources: AdapterSources | None = None
        self._locks = KeyedLocks()
        self.metrics.max_loras.set(settings.max_loras)
        self.metrics.max_cpu_loras.set(settings.max_cpu_loras)
        self.metrics.loras_registered.set_function(lambda: len(self.adapter_uris()))

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Model loaded and the engine's step loop alive and making progress."""
        return self._engine is not None and self.unhealthy() is None

    def unhealthy(self) -> str | None:
        """Why the worker should be restarted, or None: its engine loop died, or made no progress for
        `stall_timeout_s` with requests waiting (a wedged step). A model still loading is healthy."""
        engine = self._engine
        if engine is None:
            return None
        if not engine.running:
            return "the engine loop has stopped"
        timeout = self.settings.stall_timeout_s
        stalled = time.monotonic() - engine.progress_at
        if timeout > 0 and engine.num_pending > 0 and stalled > timeout:
            return f"the engine loop made no progress for {stalled:.0f}s with {engine.num_pending} requests pending"
        return None

    async def start(self) -> None:
        """Load tokenizer and model (off the event loop), then start the engine's step loop."""
        s = self.settings
        t0 = time.monotonic()
        log.info("loading model %s from %s (device=%s, dtype=%s)", self.model_name, s.model_dir, s.device, s.dtype)
        # torch & co. import for seconds: keep the event loop (and /health) responsive meanwhile
        await asyncio.to_thread(importlib.import_module, "lorafleet_worker.core.engine")
        from lorafleet_sync.sources import AdapterSources

        from lorafleet_worker.core.engine import Engine

        tokenizer = await asyncio.to_thread(Tokenizer.from_dir, s.model_dir, chat_template=s.chat_template)
        engine = await asyncio.to_thread(Engine, s.model_dir, **s.engine_kwargs())
        await engine.start()
        self._sources = AdapterSources.from_env(cache_dir=s.lora_cache_dir)
        self.metrics.attach_engine(
            lambda: engine.stats,
            lambda: _manager_stats(engine),
            model_name=self.model_name,
            max_loras=s.max_loras if s.lora_enabled else 0,
        )
        self._tokenizer, self._engine = tokenizer, engine
        self.metrics.ready.set(1)
        log.info("model %s ready in %.1fs", self.model_name, time.monotonic() - t0)
        log.info(huge_pages.describe(os.environ, huge_pages.kernel_mode(), huge_pages.huge_bytes()))

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        self.metrics.ready.set(0)
        if engine is not None:
            await engine.stop()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise APIError(503, "the model is still loading")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise APIError(503, "the model is still loading")
        return self._tokenizer

    # --- auth --------------------------------------------------------------------------------------

    def check_admin(self, authorization: str | None) -> None:
        """401 without a bearer token, 403 with a wrong one (only when a token is configured)."""
        expected = self.settings.admin_token
        if not expected:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "admin token required: send 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise APIError(403, "invalid admin token")

    # --- adapters ----------------------------------------------------------------------------------

    def _adapters(self) -> AdapterManager | None:
        """The engine's adapter manager (None while the model loads, or without LoRA)."""
        return self._engine.manager if self._engine is not None else None

    def loras(self) -> dict[str, int]:
        return {name: lora_id(name) for name in self.adapter_uris()}

    def capacity(self) -> int | None:
        """How many adapters this worker can hold at once (``--max-loaded-loras``; None: unlimited)."""
        return self.settings.max_loaded_loras

    def adapter_uris(self) -> dict[str, str]:
        """Loaded adapters and the URIs they came from, by name."""
        manager = self._adapters()
        return manager.sources() if manager is not None else {}

    # --- the engine, as the HTTP handlers use it ---------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.config.eos_token_ids)

    async def compile_grammar(self, constraint: Constraint) -> CompiledGrammar:
        """Compile a structured-output constraint off the event loop (cached); raises GrammarError."""
        return await asyncio.to_thread(self.engine.compile, constraint)

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        grammar: CompiledGrammar | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Submit a request to the engine (core/engine.py `Engine.generate`)."""
        return self.engine.generate(request_id, prompt_ids, params, adapter, grammar=grammar)

    def interrupt(self, request_id: str, exc: BaseException) -> None:
        """The request's token stream raises `exc` at its next read (no-op once the engine is gone)."""
        if self._engine is not None:
            self._engine.interrupt(request_id, exc)

    def resolve_model(self, model: str) -> str | None:
        """The adapter a request's `model` names (None = the base model); 404 when unknown."""
        if model == self.model_name:
            return None
        manager = self._adapters()
        if manager is not None and manager.source_of(model) is not None:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def load_adapter(self, name: str, uri: str, *, replace: bool = True) -> LoadResult:
        """Load `uri` as `name`: idempotent for the same URI, a hot swap for a different one.

        With `replace=False` (vLLM's `load_inplace: false`) a different URI under a loaded name is refused.
        """
        check_lora_name(name)
        if name == self.model_name:
            raise APIError(400, f"lora_name {name!r} is the base model's name")
        if not self.settings.lora_enabled:
            raise APIError(400, "LoRA is disabled on this worker (DYN_LORA_ENABLED=false)")
        engine = self.engine
        t0 = time.monotonic()
        async with self._locks.hold(name):
            previous = self._source_of(name)
            if previous == uri:
                return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' already loaded")
            if previous is not None and not replace:
                raise APIError(
                    400,
                    f"LoRA adapter '{name}' is already loaded from {previous}; set load_inplace: true to replace it",
                    param="load_inplace",
                )
            try:
                path = await self._fetch(uri)
                await self._add_to_engine(engine, name, path, uri, replace=previous is not None)
            except APIError:
                self.metrics.lora_loads.labels(outcome="error").inc()
                raise  # logged by the HTTP error handler
            self._pin(uri, True)
            if previous is not None:
                self._pin(previous, False)
        elapsed = time.monotonic() - t0
        self.metrics.lora_loads.labels(outcome="success").inc()
        self.metrics.lora_load_latency.observe(elapsed)
        verb = "swapped" if previous is not None else "loaded"
        log.info("adapter %s %s from %s in %.2fs (lora_id %d)", name, verb, uri, elapsed, lora_id(name))
        return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' {verb} successfully")

    async def unload_adapter(self, name: str) -> LoadResult:
        """Refuse new requests for `name` at once; return after its in-flight requests finished."""
        check_lora_name(name)
        engine = self.engine
        t0 = time.monotonic()
        async with self._locks.hold(name):
            uri = self._source_of(name)
            if uri is None:
                self.metrics.lora_unloads.labels(outcome="not_found").inc()
                raise APIError(404, f"LoRA adapter '{name}' is not loaded")
            try:
                await engine.remove_adapter(name)  # refuses new requests at once, then waits for the in-flight
            finally:
                self._pin(uri, False)
        elapsed = time.monotonic() - t0
        self.metrics.lora_unloads.labels(outcome="success").inc()
        self.metrics.lora_unload_latency.observe(elapsed)
        log.info("adapter %s unloaded in %.2fs", name, elapsed)
        return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' unloaded successfully")

    async def _fetch(self, uri: str) -> Path:
        assert self._sources is not None
        try:
            return await self._sources.fetch(uri)
        except SourceError as e:
            raise APIError(e.status, e.message) from e

    def _source_of(self, name: str) -> str | None:
        manager = self._adapters()
        return manager.source_of(name) if manager is not None else None

    async def _add_to_engine(self, engine: Engine, name: str, path: Path, uri: str, *, replace: bool) -> None:
        from lorafleet_worker.lora.errors import LoRAError

        try:
            await engine.add_adapter(name, path, replace=replace, source=uri)
        except LoRAError as e:  # each carries its HTTP status (lora/errors.py)
            raise APIError(e.status, e.message) from e
        except Exception as e:  # a bad adapter must never take the worker down
            log.exception("unexpected error while loading adapter %s from %s", name, path)
            raise APIError(500, f"internal error while loading adapter '{name}': {type(e).__name__}: {e}") from e

    def _pin(self, uri: str, pinned: bool) -> None:
        if self._sources is not None:
            (self._sources.pin if pinned else self._sources.unpin)(uri)


def path_to_uri(lora_path: str) -> str:
    """vLLM's `lora_path`: an absolute local directory (or already a URI) -> a source URI."""
    if "://" in lora_path:
        return lora_path
    if not Path(lora_path).is_absolute():
        raise APIError(400, f"lora_path must be an absolute path or a URI, got {lora_path!r}", param="lora_path")
    return "file://" + quote(lora_path)


def _manager_stats(engine: Engine) -> Any:
    return None if engine.manager is None else engine.manager.stats
