"""The workers' catalogues: which adapters each worker pod may load on demand, and telling it.

A base model's catalogue, per namespace, is ``ModelIndex.catalog``: (modelName, URI) of every LoRA
DynamoModel that owns its name and has a version the operator loaded (``Model.catalog_uri``, the
URI ``POST /v1/loras`` sends). ``Catalogs`` pushes it with ``PUT /v1/loras/catalog`` to every Ready
worker pod of that base model when it changes and when a pod becomes Ready. It is level-triggered:
what each pod was last told is kept, and a pod is told again only when that differs (a pod that
turns unready or restarts is forgotten, so it is told again once Ready). A worker that answers
404 or 405 does not serve catalogues (an older worker): that is logged once and the pod is not
asked again until it restarts. Other failures are retried per base model with exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lorafleet_operator.resources import Model, Pod
from lorafleet_operator.workers import CatalogUnsupported, WorkerClient, WorkerError

log = logging.getLogger(__name__)

Group = tuple[str, str]  # (namespace, base-model hash)
Entries = tuple[tuple[str, str], ...]  # (modelName, URI), sorted


def _entry(model: Model | None) -> tuple[Group, str, str] | None:
    if model is None or model.catalog_uri is None:
        return None
    return (model.namespace, model.base_hash), model.model_name, model.catalog_uri


class Catalogs:
    """What each worker pod was told, and the task that tells pods what changed."""

    def __init__(
        self,
        client: WorkerClient,
        port: int,
        catalog: Callable[[str, str], Sequence[tuple[str, str]]],
        pods: Callable[[str, str], Sequence[Pod]],
        retry_base: float = 1.0,
        retry_max: float = 60.0,
    ) -> None:
        self.client = client
        self.port = port
        self._catalog = catalog  # (namespace, base hash) -> entries: ModelIndex.catalog
        self._pods = pods  # (namespace, base hash) -> pods: WorkerInventory.pods_of
        self.retry_base, self.retry_max = retry_base, retry_max
        self._told: dict[str, Entries] = {}  # pod uid -> the catalogue it acknowledged
        self._unsupported: set[str] = set()  # pod uids of workers without catalogues
        self._warned = False
        self._dirty: set[Group] = set()
        self._failures: dict[Group, int] = {}
        self._wakeup = asyncio.Event()

    # ---- inputs -------------------------------------------------------------------------
    def on_model(self, old: Model | None, new: Model | None) -> None:
        """A DynamoModel changed (``ModelIndex``'s ``on_change``): its base model's catalogue may have."""
        before, after = _entry(old), _entry(new)
        if before != after:
            for entry in (before, after):
                if entry is not None:
                    self.mark(entry[0])
        elif new is not None and old is not None and new.seniority != old.seniority:
            self.mark((new.namespace, new.base_hash))

    def on_pod(self, pod: Pod, old: Pod | None = None) -> None:
        """A pod event: a pod that is not Ready (or was replaced) is forgotten; a Ready one not told yet is told."""
        if old is not None and old.uid != pod.uid:
            self._forget(old.uid)
        if not (pod.ready and pod.ip):
            self._forget(pod.uid)
        elif pod.base_hash and pod.uid not in self._told and pod.uid not in self._unsupported:
            self.mark((pod.namespace, pod.base_hash))

    def mark(self, group: Group) -> None:
        """Check that every Ready pod of ``group`` holds its current catalogue (soon, in the push task)."""
        self._dirty.add(group)
        self._wakeup.set()

    def _forget(self, uid: str) -> None:
        self._told.pop(uid, None)
        self._unsupported.discard(uid)

    # ---- the push task ---------------------------------------------------------------------
    async def run(self) -> None:
        """Push changed catalogues until cancelled (groups marked meanwhile are pushed together)."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            groups, self._dirty = self._dirty, set()
            for group in sorted(groups):
                try:
                    done = await self.push(group)
                except Exception:
                    log.exception("pushing the adapter catalogue of %s/%s failed", *group)
                    done = False
                self._retry_later(group, done)

    def _retry_later(self, group: Group, done: bool) -> None:
        if done:
            self._failures.pop(group, None)
            return
        failures = self._failures[group] = self._failures.get(group, 0) + 1
        delay = min(self.retry_max, self.retry_base * 2 ** (failures - 1))
        asyncio.get_running_loop().call_later(delay, self.mark, group)

    async def push(self, group: Group) -> bool:
        """Tell every Ready pod of ``group`` that was told something else; True when all have it."""
        entries: Entries = tuple(self._catalog(*group))
        stale = [
            p for p in self._pods(*group)
            if p.ready and p.ip and p.uid not in self._unsupported and self._told.get(p.uid) != entries
        ]  # fmt: skip
        told: list[Coroutine[Any, Any, bool]] = [self._tell(p, entries) for p in stale]
        return all(await asyncio.gather(*told))

    async def _tell(self, pod: Pod, entries: Entries) -> bool:
        try:
            await self.client.put_catalog(pod.address(self.port), entries)
        except CatalogUnsupported as e:
            self._unsupported.add(pod.uid)
            if not self._warned:
                self._warned = True
                log.warning("worker pod %s does not serve adapter catalogues (%s): adapters are not loaded on "
                            "demand there (older workers; logged once)", pod.name, e)  # fmt: skip
            else:
                log.debug("worker pod %s does not serve adapter catalogues", pod.name)
            return True
        except WorkerError as e:
            log.warning("pushing the adapter catalogue to pod %s failed: %s (retrying)", pod.name, e)
            return False
        self._told[pod.uid] = entries
        log.debug("pod %s: catalogue of %d adapter(s)", pod.name, len(entries))
        return True
