"""The adapters of one vLLM server as lorafleet's management API sees them: load (fetch from the store, then
vLLM's ``load_lora_adapter``), hot swap, unload, list with capacity.

vLLM's ``/v1/models`` is the one record of what is held; this module keeps only which source URI each held
name came from, pruned against vLLM on every listing (a restarted vLLM holds nothing, and the operator's drift
pass loads its adapters again). Adapters vLLM already holds when the sidecar starts (a restarted sidecar) are
adopted: listed, their URI unknown until the next load of that name reloads them in place.

Adapters are fetched with the worker's own source code (``lorafleet_sync.sources``: ``s3://``, ``hf://``,
``file://``, the disk cache, manifest checks) into a directory vLLM can read (the pod's shared volume); a
fetched adapter's cache entry stays pinned while vLLM serves it. Loads and unloads of one name are serialized.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lorafleet_sync.errors import SourceError
from lorafleet_sync.ids import lora_id, lora_name_problem

from lorafleet_sidecar.metrics import SidecarMetrics
from lorafleet_sidecar.vllm import VllmClient, VllmError

log = logging.getLogger(__name__)


class ManagementError(Exception):
    """A management call's failure: the HTTP status and message the management API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Sources(Protocol):
    """What the sidecar needs of ``lorafleet_sync.sources.AdapterSources``."""

    async def fetch(self, uri: str, *, pin: bool = False) -> Path: ...

    def unpin(self, uri: str) -> None: ...


@dataclass(frozen=True)
class LoadResult:
    lora_name: str
    lora_id: int
    message: str


class VllmAdapters:
    """Loads, swaps, unloads and lists the adapters of the vLLM server behind ``vllm`` (module docstring)."""

    def __init__(
        self,
        vllm: VllmClient,
        sources: Sources,
        *,
        capacity: int | None = None,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.vllm = vllm
        self.sources = sources
        self.capacity = capacity
        self.metrics = metrics or SidecarMetrics()
        self._uris: dict[str, str | None] = {}  # held name -> the URI it was loaded from (None: adopted)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # per name, as vLLM keeps them
        self._loading: set[str] = set()  # new names being fetched and loaded (they count against capacity)
        self.reconciled = False

    async def held(self) -> dict[str, str | None]:
        """What vLLM serves now, name -> source URI (None when unknown); records of names vLLM dropped go."""
        try:
            served = await self.vllm.adapters()
        except VllmError as e:
            raise ManagementError(e.status, e.message) from None
        for name in [n for n in self._uris if n not in served]:
            uri = self._uris.pop(name)
            log.warning("vLLM no longer serves adapter %s (restarted?): dropped from the listing", name)
            if uri is not None:
                self.sources.unpin(uri)
        for name in served.keys() - self._uris.keys():
            log.info("adopted adapter %s that vLLM already serves (from %s)", name, served[name])
            self._uris[name] = None
        self.reconciled = True
        self.metrics.loras_held.set(len(served))
        return {name: self._uris.get(name) for name in served}

    async def ready(self) -> str | None:
        """None when the sidecar can serve: vLLM's ``/health`` answers and the first listing is done; else why not."""
        up = await self.vllm.healthy()
        self.metrics.vllm_up.set(int(up))
        if not up:
            return f"vLLM at {self.vllm.url} is not healthy yet"
        if not self.reconciled:
            try:
                await self.held()
            except ManagementError as e:
                return e.message
        return None

    async def load(self, name: str, uri: str) -> LoadResult:
        """Load ``uri`` as ``name``: idempotent for the same URI, a hot swap (vLLM's ``load_inplace``) for another."""
        check_name(name)
        t0 = time.monotonic()
        async with self._locks[name]:
            try:
                held = await self.held()
                previous = held.get(name, False)
                if previous == uri:
                    return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' already loaded")
                swap = name in held
                if not swap:
                    self._check_room(held)
                    self._loading.add(name)
                path = await self._fetch(uri)
                try:
                    await self.vllm.load(name, str(path), inplace=swap)
                except VllmError as e:
                    self.sources.unpin(uri)
                    status = 400 if e.vllm_status == 404 else e.status  # vLLM: no adapter at that path
                    raise ManagementError(status, f"loading adapter '{name}' into vLLM failed: {e.message}") from None
                self._uris[name] = uri
                if isinstance(previous, str):
                    self.sources.unpin(previous)
            except ManagementError:
                self.metrics.loads.labels(outcome="error").inc()
                raise
            finally:
                self._loading.discard(name)
        elapsed = time.monotonic() - t0
        self.metrics.loads.labels(outcome="success").inc()
        self.metrics.load_seconds.observe(elapsed)
        verb = "swapped" if swap else "loaded"
        log.info("adapter %s %s from %s in %.2fs (vLLM path %s)", name, verb, uri, elapsed, path)
        return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' {verb} successfully")

    async def unload(self, name: str) -> LoadResult:
        """Unload ``name`` from vLLM (404 when vLLM does not serve it)."""
        check_name(name)
        async with self._locks[name]:
            try:
                await self.vllm.unload(name)
            except VllmError as e:
                if e.vllm_status == 404:
                    self.metrics.unloads.labels(outcome="not_found").inc()
                    raise ManagementError(404, f"LoRA adapter '{name}' is not loaded") from None
                self.metrics.unloads.labels(outcome="error").inc()
                raise ManagementError(e.status, f"unloading adapter '{name}' from vLLM failed: {e.message}") from None
            uri = self._uris.pop(name, None)
            if uri is not None:
                self.sources.unpin(uri)
        self.metrics.unloads.labels(outcome="success").inc()
        log.info("adapter %s unloaded", name)
        return LoadResult(name, lora_id(name), f"LoRA adapter '{name}' unloaded successfully")

    def _check_room(self, held: dict[str, str | None]) -> None:
        if self.capacity is not None and len(held.keys() | self._loading) >= self.capacity:
            raise ManagementError(
                507, f"this vLLM worker holds {self.capacity} adapters, its capacity (--max-loaded-loras)"
            )

    async def _fetch(self, uri: str) -> Path:
        try:
            return await self.sources.fetch(uri, pin=True)
        except SourceError as e:
            raise ManagementError(e.status, e.message) from None


def check_name(name: str) -> None:
    """SPEC §2: 1-128 characters of ``[A-Za-z0-9._/-]``, no ``..``."""
    if problem := lora_name_problem(name):
        raise ManagementError(400, problem)
