"""Which adapter names the operator placed on the workers of a base model (and may unload).

The workers' ``GET /v1/loras`` lists names only; an adapter someone loaded by hand looks the
same as one the operator loaded. The operator therefore writes a name down *before* its first
load (write-ahead: a crash between the two cannot leak it) and crosses it out once no worker
holds it any more. The drift pass unloads a listed name that no DynamoModel wants (renamed,
deleted while the operator was down); a name that is not written down is never touched.

``ConfigMapLedger`` keeps the record in one ConfigMap per namespace, ``lorafleet-adapters``,
one data key per base-model hash holding the sorted names, one per line (10,000 names of 40
characters are ~400 KB, under the 1 MiB object limit). It is read once per namespace, then
written only when names are added or removed, in batches. The runtime writes the names of
new DynamoModels down in bulk as it sees them (``claim_many``, one write for a whole list of
them at a cold start), so the claim before each first load finds its name already written; a
name written down that no pod ends up holding is crossed out by the drift pass like any other.
``MemoryLedger`` is the same without Kubernetes.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

from lorafleet_operator.kube import KubeClient, KubeError, collection_path

CONFIGMAP = "lorafleet-adapters"


class Ledger(Protocol):
    async def claim(self, namespace: str, base_hash: str, name: str) -> None: ...
    async def claim_many(self, namespace: str, base_hash: str, names: Iterable[str]) -> None: ...
    async def release(self, namespace: str, base_hash: str, name: str) -> None: ...
    async def names(self, namespace: str, base_hash: str) -> set[str]: ...


class MemoryLedger:
    """The record in memory (tests, and an operator without the ConfigMap)."""

    def __init__(self) -> None:
        self._names: defaultdict[tuple[str, str], set[str]] = defaultdict(set)

    async def claim(self, namespace: str, base_hash: str, name: str) -> None:
        self._names[(namespace, base_hash)].add(name)

    async def claim_many(self, namespace: str, base_hash: str, names: Iterable[str]) -> None:
        self._names[(namespace, base_hash)].update(names)

    async def release(self, namespace: str, base_hash: str, name: str) -> None:
        self._names[(namespace, base_hash)].discard(name)

    async def names(self, namespace: str, base_hash: str) -> set[str]:
        return set(self._names[(namespace, base_hash)])


class ConfigMapLedger(MemoryLedger):
    """The record in the ConfigMap ``lorafleet-adapters`` of each namespace.

    Writes are group-committed: every claim or release waits for a write that includes it, and
    all changes made while one write is in flight go out together in the next (a cold start of
    thousands of models costs a few dozen writes, not one per name)."""

    def __init__(self, kube: KubeClient) -> None:
        super().__init__()
        self.kube = kube
        self._loaded: set[str] = set()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._next: dict[str, asyncio.Future[None]] = {}  # namespace -> the write not started yet
        self._unwritten: defaultdict[str, set[tuple[str, str]]] = defaultdict(set)  # claimed, not yet written
        self.writes = 0

    async def claim(self, namespace: str, base_hash: str, name: str) -> None:
        await self.claim_many(namespace, base_hash, (name,))

    async def claim_many(self, namespace: str, base_hash: str, names: Iterable[str]) -> None:
        """Return once every name of ``names`` is written down (one write for all that were not)."""
        await self._load(namespace)
        known, unwritten = self._names[(namespace, base_hash)], self._unwritten[namespace]
        wait = False
        for name in names:
            if name not in known:
                known.add(name)
                unwritten.add((base_hash, name))
                wait = True
            elif (base_hash, name) in unwritten:
                wait = True  # claimed by someone else, its write has not succeeded yet
        if wait:
            await self._commit(namespace)

    async def release(self, namespace: str, base_hash: str, name: str) -> None:
        await self._load(namespace)
        if name in self._names[(namespace, base_hash)]:
            await super().release(namespace, base_hash, name)
            self._unwritten[namespace].discard((base_hash, name))
            await self._commit(namespace)

    async def names(self, namespace: str, base_hash: str) -> set[str]:
        await self._load(namespace)
        return await super().names(namespace, base_hash)

    def _path(self, namespace: str) -> str:
        return collection_path("", "v1", "configmaps", namespace) + f"/{CONFIGMAP}"

    async def _load(self, namespace: str) -> None:
        if namespace in self._loaded:
            return
        async with self._locks[namespace]:
            if namespace in self._loaded:
                return
            body = await self.kube.get(self._path(namespace))
            for base_hash, text in ((body or {}).get("data") or {}).items():
                self._names[(namespace, base_hash)] |= {n for n in text.splitlines() if n}
            self._loaded.add(namespace)

    async def _commit(self, namespace: str) -> None:
        """Return once a write that includes every change made so far has succeeded."""
        pending = self._next.get(namespace)
        if pending is None:
            pending = self._next[namespace] = asyncio.ensure_future(self._write(namespace))
        await asyncio.shield(pending)

    async def _write(self, namespace: str) -> None:
        async with self._locks[namespace]:
            self._next.pop(namespace, None)  # changes from now on go into the next write
            included = set(self._unwritten[namespace])
            data = {
                base_hash: "".join(f"{n}\n" for n in sorted(names))
                for (ns, base_hash), names in self._names.items()
                if ns == namespace
            }
            self.writes += 1
            try:
                await self.kube.merge_patch(self._path(namespace), {"data": data})
            except KubeError as e:
                if e.status != 404:
                    raise
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": CONFIGMAP,
                        "namespace": namespace,
                        "labels": {"app.kubernetes.io/managed-by": "lorafleet-operator"},
                    },
                    "data": data,
                }
                await self.kube.create(collection_path("", "v1", "configmaps", namespace), body)
            self._unwritten[namespace] -= included
