"""The worker's shared state behind both HTTP servers: engine, tokenizer, adapter registry, admin token."""

from __future__ import annotations

import asyncio
import hmac
import importlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from lorafleet_sync.errors import SourceError
from lorafleet_sync.ids import lora_id
from lorafleet_sync.uris import URIError, parse_uri

from lorafleet_worker.api.protocol import APIError, check_lora_name
from lorafleet_worker.catalog import Catalog
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

    def busy(self, key: str) -> bool:
        """Someone holds or waits for `key`'s lock."""
        return key in self._locks


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

    Adapters on demand: an inference request may name an adapter that the worker does not hold but
    that is in its catalogue (`set_catalog`); the worker then loads it itself (one load per name however
    many requests wait, each waiting at most `--lora-load-timeout`). Such an adapter is unpinned; one
    loaded by the management API is pinned (and a management load of an unpinned one pins it). When
    `--max-loaded-loras` adapters are held, a load first evicts the least recently used unpinned adapter
    that no request holds; a pinned adapter is never evicted.
    """

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.model_name = settings.served_model_name
        self._engine: Engine | None = None
        self._tokenizer: Tokenizer | None = None
        self._sources: AdapterSources | None = None
        self._locks = KeyedLocks()
        self._catalog = Catalog()
        self._unpinned: set[str] = set()  # held adapters that were loaded on demand
        self._recent: OrderedDict[str, None] = OrderedDict()  # held adapters, least recently used first
        self._loading: set[str] = set()  # names being fetched and loaded (they count against the capacity)
        self._flights: dict[str, asyncio.Future[None]] = {}  # on-demand loads in progress, by name
        self._started = False  # `start` has loaded the model and the --lora-modules adapters
        self.metrics.max_loras.set(settings.max_loras)
        self.metrics.max_cpu_loras.set(settings.max_cpu_loras)
        self.metrics.loras_registered.set_function(lambda: len(self.adapter_uris()))

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Model and `--lora-modules` loaded, and the engine's step loop alive and making progress."""
        return self._started and self._engine is not None and self.unhealthy() is None

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
        """Load tokenizer and model (off the event loop), start the engine's step loop, then load the
        `--lora-modules` adapters (a relative path is a local directory); ready after all of them."""
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
        kv = engine.core.kv_cache
        self.metrics.attach_engine(
            lambda: engine.stats,
            lambda: _manager_stats(engine),
            model_name=self.model_name,
            max_loras=s.max_loras if s.lora_enabled else 0,
            cache_config={"block_size": str(kv.block_size), "num_gpu_blocks": str(kv.num_blocks)},
        )
        self._tokenizer, self._engine = tokenizer, engine
        for module in s.lora_modules:  # as in vLLM: one that cannot be loaded fails the start
            result = await self.load_adapter(module.name, lora_module_uri(module.path))
            log.info("--lora-modules: %s", result.message)
        self._started = True
        self.metrics.ready.set(1)
        log.info("model %s ready in %.1fs", self.model_name, time.monotonic() - t0)
        log.info(huge_pages.describe(os.environ, huge_pages.kernel_mode(), huge_pages.huge_bytes()))

    async def stop(self) -> None:
        self._started = False
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

    def pinned(self) -> dict[str, bool]:
        """Every loaded adapter by name: True when the management API placed it, False when loaded on demand."""
        return {name: name not in self._unpinned for name in self.adapter_uris()}

    # --- the catalogue -----------------------------------------------------------------------------

    def set_catalog(self, entries: Iterable[tuple[str, str]]) -> int:
        """Replace the catalogue with `entries` (name, source URI); a bad entry is a 400 and changes nothing."""
        if not self.settings.lora_enabled:
            raise APIError(400, "LoRA is disabled on this worker (DYN_LORA_ENABLED=false)")
        catalog: dict[str, str] = {}
        for name, uri in entries:
            check_lora_name(name)
            if name == self.model_name:
                raise APIError(400, f"lora_name {name!r} is the base model's name", param="lora_name")
            if name in catalog:
                raise APIError(400, f"lora_name {name!r} appears more than once in the catalogue", param="lora_name")
            try:
                parse_uri(uri)
            except URIError as e:
                raise APIError(400, f"adapter {name!r}: {e}", param="source.uri") from e
            catalog[name] = uri
        self._catalog.replace(catalog)
        log.info("adapter catalogue replaced: %d adapters", len(catalog))
        return len(catalog)

    def catalog(self) -> dict[str, str]:
        """The catalogue: every adapter this worker may load on demand and its source URI, by name."""
        return self._catalog.entries()

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
        """Submit a request to the engine (core/engine.py `Engine.generate`). A catalogued adapter evicted between
        `serve_model` and here (other adapters' loads under full capacity) is a 503 to retry, not a 404."""
        from lorafleet_worker.lora.errors import AdapterNotFoundError

        try:
            return self.engine.generate(request_id, prompt_ids, params, adapter, grammar=grammar)
        except AdapterNotFoundError:
            if adapter is None or self._catalog.uri_of(adapter) is None:
                raise
            raise APIError(
                503,
                f"LoRA adapter '{adapter}' was evicted before this request started; retry",
                param="model",
                type="capacity",
            ) from None

    def interrupt(self, request_id: str, exc: BaseException) -> None:
        """The request's token stream raises `exc` at its next read (no-op once the engine is gone)."""
        if self._engine is not None:
            self._engine.interrupt(request_id, exc)

    def resolve_model(self, model: str) -> str | None:
        """The adapter a request's `model` names (None = the base model): one the worker holds or one in its
        catalogue (`serve_model` loads it); 404 when neither."""
        if model == self.model_name:
            return None
        if self._source_of(model) is not None:
            if model in self._recent:
                self._recent.move_to_end(model)
            return model
        if self._catalog.uri_of(model) is not None and self.settings.lora_enabled:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def serve_model(self, model: str) -> str | None:
        """`resolve_model`, then load a catalogued adapter that the worker does not hold (on demand): one load
        per name, each caller waiting at most `--lora-load-timeout` seconds (then a 503 naming it)."""
        adapter = self.resolve_model(model)
        if adapter is None or self._source_of(adapter) is not None:
            return adapter
        flight = self._flights.get(adapter)
        if flight is None:
            flight = asyncio.ensure_future(self._load_on_demand(adapter))
            self._flights[adapter] = flight
            flight.add_done_callback(lambda f: self._landed(adapter, f))
        timeout = self.settings.lora_load_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(flight), timeout)
        except TimeoutError:
            log.warning(
                "request for adapter %s gave up after %gs: its on-demand load is still running", adapter, timeout
            )
            raise APIError(
                503,
                f"LoRA adapter '{adapter}' is being loaded and was not ready within {timeout:g}s; retry later",
                param="model",
            ) from None
        return adapter

    def _landed(self, name: str, flight: asyncio.Future[None]) -> None:
        if self._flights.get(name) is flight:
            del self._flights[name]
        if not flight.cancelled():
            flight.exception()  # every waiter has been answered: nothing else reads it

    async def _load_on_demand(self, name: str) -> None:
        """Load catalogued `name` unpinned, after making room for it; every failure is a 503 naming it."""
        engine = self.engine
        async with self._locks.hold(name):
            if self._source_of(name) is not None:  # loaded meanwhile
                return
            uri = self._catalog.uri_of(name)
            if uri is None:
                raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
            if not await self._make_room(name):
                self.metrics.lora_on_demand_loads.labels(outcome="capacity").inc()
                raise APIError(
                    503,
                    f"cannot load LoRA adapter '{name}': all {self.capacity()} adapter places (--max-loaded-loras) "
                    "hold pinned adapters or adapters with requests in flight",
                    param="model",
                    type="capacity",
                )
            t0 = time.monotonic()
            self._loading.add(name)
            try:
                path = await self._fetch(uri)
                await self._add_to_engine(engine, name, path, uri, replace=False)
            except APIError as e:
                self.metrics.lora_on_demand_loads.labels(outcome="error").inc()
                log.warning("on-demand load of adapter %s from %s failed: %s", name, uri, e.message)
                raise APIError(503, f"LoRA adapter '{name}' could not be loaded: {e.message}", param="model") from e
            finally:
                self._loading.discard(name)
            self._unpinned.add(name)
            self._recent[name] = None
            self._pin(uri, True)
        elapsed = time.monotonic() - t0
        self.metrics.lora_on_demand_loads.labels(outcome="success").inc()
        self.metrics.lora_load_latency.observe(elapsed)
        log.info("adapter %s loaded on demand from %s in %.2fs (lora_id %d)", name, uri, elapsed, lora_id(name))

    async def _make_room(self, name: str) -> bool:
        """Make a place for a new adapter `name` under `--max-loaded-loras`, evicting the least recently used
        unpinned adapter that no request holds if need be; False when there is no place and nothing to evict."""
        capacity = self.capacity()
        if capacity is None or len(self.adapter_uris().keys() | self._loading) < capacity:
            return True
        manager = self._adapters()
        victim = next(
            (
                held
                for held in self._recent
                if held in self._unpinned and not self._locks.busy(held) and manager and manager.in_flight(held) == 0
            ),
            None,
        )
        if victim is None:
            return False
        uri = self._source_of(victim)
        await self.engine.remove_adapter(victim)  # removed before anything else runs: no request can take it now
        self._forget(victim)
        if uri is not None:
            self._pin(uri, False)
        self.metrics.lora_on_demand_evictions.inc()
        log.info(
            "adapter %s evicted to make room for %s: loaded on demand, least recently used, no request in flight "
            "(--max-loaded-loras %d reached)",
            victim,
            name,
            capacity,
        )
        return True

    def _forget(self, name: str) -> None:
        """`name` is no longer held: drop its on-demand bookkeeping."""
        self._unpinned.discard(name)
        self._recent.pop(name, None)

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
                if name in self._unpinned:
                    self._unpinned.discard(name)
                    log.info("adapter %s (loaded on demand) pinned", name)
                return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' already loaded")
            if previous is not None and not replace:
                raise APIError(
                    400,
                    f"LoRA adapter '{name}' is already loaded from {previous}; set load_inplace: true to replace it",
                    param="load_inplace",
                )
            if previous is None:
                await self._make_room(name)  # without a place the engine answers 507
                self._loading.add(name)
            try:
                path = await self._fetch(uri)
                await self._add_to_engine(engine, name, path, uri, replace=previous is not None)
            except APIError:
                self.metrics.lora_loads.labels(outcome="error").inc()
                raise  # logged by the HTTP error handler
            finally:
                self._loading.discard(name)
            self._unpinned.discard(name)
            self._recent[name] = None
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
                self._forget(name)
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


def lora_module_uri(path: str) -> str:
    """A `--lora-modules` path -> its source URI: a URI as it is, a local directory (relative: to the working
    directory) as a file URI."""
    return path_to_uri(path if "://" in path else str(Path(path).resolve()))


def _manager_stats(engine: Engine) -> Any:
    return None if engine.manager is None else engine.manager.stats
