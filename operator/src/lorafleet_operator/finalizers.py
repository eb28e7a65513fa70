"""Our finalizer ``nvidia.com/finalizer`` on DynamoModels: put on before an object's first load
(one PATCH), and, once the object is being deleted, removed after ``finalize`` unloaded it
(retried with backoff; one finalization at a time per object).

kopf's own finalizer machinery is not used: the DynamoModel watch is the runtime's informer
(see controller.py), so this module owns the finalizer's whole life.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from lorafleet_operator.api import FINALIZER, model_path
from lorafleet_operator.index import Key, key_of
from lorafleet_operator.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

Finalize = Callable[[Mapping[str, Any]], Awaitable[list[str]]]


class Finalizers:
    """Adds our finalizer, and runs ``finalize`` then removes it for objects being deleted."""

    def __init__(self, kube: KubeClient | None, finalize: Finalize, retry_base: float, retry_max: float) -> None:
        self.kube = kube  # None: no finalizers (tests without an API server)
        self._finalize = finalize
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._released: set[str] = set()  # uids released, until their DELETED event (stale events)

    def stale(self, kind: str | None, body: Mapping[str, Any]) -> bool:
        """An event older than our finalizer removal (the object is as good as gone)."""
        uid = (body.get("metadata") or {}).get("uid", "")
        if kind == "DELETED":
            self._released.discard(uid)
            return False
        return uid in self._released

    def on_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        """An object being deleted that still carries our finalizer is finalized (once at a time)."""
        meta = body.get("metadata") or {}
        if kind == "DELETED" or not meta.get("deletionTimestamp") or FINALIZER not in (meta.get("finalizers") or []):
            return
        key = key_of(body)
        if key not in self._running:
            task = asyncio.create_task(self._finalize_and_release(body))
            self._running[key] = task
            task.add_done_callback(lambda _t: self._running.pop(key, None))

    async def ensure(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Before the first load of an object: put our finalizer on it (one PATCH, once).

        Returns the object to reconcile (None: it is gone or being deleted meanwhile)."""
        if self.kube is None or FINALIZER in ((body.get("metadata") or {}).get("finalizers") or []):
            return dict(body)
        try:
            updated = await self._edit(body, add=True)
        except KubeError as e:
            if e.status == 422:  # being deleted: no finalizer may be added any more
                return None
            raise
        if updated is None or (updated.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return updated

    async def _finalize_and_release(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        delay = self.retry_base
        while True:
            try:
                unloaded = await self._finalize(body)
                log.info("%s/%s: unloaded %s from %s", meta.get("namespace"), meta.get("name"),
                         (body.get("spec") or {}).get("modelName"), unloaded or "no pod")  # fmt: skip
                await self._edit(body, add=False)
                self._released.add(meta.get("uid", ""))
                return
            except Exception:
                log.exception(
                    "finalizing %s/%s failed; retrying in %.0f s", meta.get("namespace"), meta.get("name"), delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)

    async def _edit(self, body: Mapping[str, Any], add: bool) -> dict[str, Any] | None:
        """Add or remove our finalizer (optimistic: a stale resourceVersion re-reads and retries).

        Returns the updated object (None when it is gone)."""
        if self.kube is None:
            return dict(body)
        meta = body.get("metadata") or {}
        path = model_path(meta.get("namespace", ""), meta.get("name", ""))
        current: Mapping[str, Any] | None = body
        for _ in range(5):
            if current is None:
                return None
            cmeta = current.get("metadata") or {}
            finalizers = list(cmeta.get("finalizers") or [])
            if (FINALIZER in finalizers) == add:
                return dict(current)
            finalizers = [*finalizers, FINALIZER] if add else [f for f in finalizers if f != FINALIZER]
            patch = {"metadata": {"finalizers": finalizers, "resourceVersion": cmeta.get("resourceVersion")}}
            try:
                return await self.kube.merge_patch(path, patch)
            except KubeError as e:
                if e.status == 404:
                    return None
                if e.status != 409:
                    raise
            current = await self.kube.get(path)
        raise KubeError(409, f"{path}: finalizers changed concurrently five times")

    async def stop(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
