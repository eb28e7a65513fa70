"""The worker inventory: the worker pods (fed by the pod watch) and what each holds, shared by
the reconciler and the drift pass.

What a pod holds comes from its ``GET /v1/loras`` (names and capacity), cached per pod for
``listing_ttl`` (the drift pass refreshes every listing), plus what the operator itself loaded
there (``loaded_uri``: which version, to tell a hot swap from a no-op). A pod that restarts,
turns unready or goes is forgotten at once: a restarted worker comes back empty.

A listing's names are the pinned adapters, the placement's; adapters a worker loaded on demand
(``on_demand``) are kept apart: they count neither as placement nor as drift, and are unloaded
only when their model goes away or is scaled to zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet_operator.resources import Pod
from lorafleet_operator.workers import WorkerClient, WorkerError

log = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass
class _Listing:
    names: set[str]
    fetched: float
    capacity: int | None = None  # adapters the pod can hold (None: unlimited / not reported)
    on_demand: set[str] = dataclasses.field(default_factory=set)  # loaded by the worker for a request


class WorkerInventory:
    """Worker pods by (namespace, name) and, per pod uid, its listing and our loads."""

    def __init__(self, client: WorkerClient, port: int, listing_ttl: float = 30.0) -> None:
        self.client = client
        self.port = port
        self.listing_ttl = listing_ttl
        self._pods: dict[Key, Pod] = {}
        self._groups: dict[tuple[str, str | None], list[Pod]] = {}  # pods_of, until the next pod event
        self._listings: dict[str, _Listing] = {}
        self._listing_locks: dict[str, asyncio.Lock] = {}
        self._loaded: dict[tuple[str, str], str] = {}  # (pod uid, lora name) -> URI we loaded / adopted

    # ---- pods ---------------------------------------------------------------------------
    def on_pod(self, kind: str | None, body: Mapping[str, Any]) -> tuple[Pod | None, Pod]:
        """Record a pod event; returns (the pod as it was, as it is now: unready when deleted).

        A pod that left (unready, gone, new IP or uid) is forgotten: its listing and our loads."""
        pod = Pod.from_body(body)
        key = (pod.namespace, pod.name)
        old = self._pods.get(key)
        self._groups.clear()
        if kind == "DELETED":
            self._pods.pop(key, None)
            pod = dataclasses.replace(pod, ready=False)
        else:
            self._pods[key] = pod
        moved = old is not None and (old.uid, old.ip, old.base_hash) != (pod.uid, pod.ip, pod.base_hash)
        if old is not None and (moved or not (pod.ready and pod.ip)):
            self.forget_pod(old.uid)
        return old, pod

    def pods(self) -> list[Pod]:
        return list(self._pods.values())

    def pods_of(self, namespace: str, base_hash: str | None) -> list[Pod]:
        """The pods of one base model, sorted (kept until a pod changes: a pass neither scans every
        pod nor sorts them again)."""
        group = (namespace, base_hash)
        pods = self._groups.get(group)
        if pods is None:
            pods = self._groups[group] = sorted(
                p for p in self._pods.values() if p.namespace == namespace and p.base_hash == base_hash
            )
        return pods

    # ---- what pods hold -------------------------------------------------------------------
    def invalidate_listings(self) -> None:
        """Force a fresh ``GET /v1/loras`` of every pod on its next use."""
        self._listings.clear()

    def drop_listing(self, pod: Pod) -> None:
        """Our view of this pod is stale (e.g. it answered 507): list it again on next use."""
        self._listings.pop(pod.uid, None)

    def forget_pod(self, uid: str) -> None:
        """Drop what we know about a pod (it restarted, became unready or is gone)."""
        self._listings.pop(uid, None)
        lock = self._listing_locks.get(uid)
        if lock is not None and not lock.locked():
            del self._listing_locks[uid]
        for key in [k for k in self._loaded if k[0] == uid]:
            del self._loaded[key]

    def forget_name(self, name: str) -> None:
        """Forget our loads of ``name`` everywhere (its model was deleted)."""
        for key in [k for k in self._loaded if k[1] == name]:
            del self._loaded[key]

    async def fresh_listing(self, pod: Pod) -> set[str] | None:
        """``GET /v1/loras`` now, kept (names, capacity, on-demand names) as the pod's cached listing;
        the pinned names, or None on failure."""
        try:
            inventory = await self.client.inventory(pod.address(self.port))
        except WorkerError as e:
            log.warning("cannot list adapters on pod %s: %s", pod.name, e)
            return None
        self._listings[pod.uid] = _Listing(
            set(inventory.names), time.monotonic(), inventory.capacity, set(inventory.on_demand)
        )
        return set(inventory.names)

    async def listing(self, pod: Pod) -> set[str] | None:
        """Adapter names on ``pod`` (cached), or None when it cannot be listed."""
        cached = self._fresh(pod)
        if cached is not None:
            return cached.names
        async with self._listing_locks.setdefault(pod.uid, asyncio.Lock()):
            cached = self._fresh(pod)
            return cached.names if cached is not None else await self.fresh_listing(pod)

    def _fresh(self, pod: Pod) -> _Listing | None:
        cached = self._listings.get(pod.uid)
        return cached if cached is not None and time.monotonic() - cached.fetched < self.listing_ttl else None

    async def listings_of(self, pods: Sequence[Pod]) -> dict[Pod, set[str] | None]:
        """``listing`` of each pod: cached ones at once, only stale ones fetched (concurrently)."""
        out: dict[Pod, set[str] | None] = {}
        stale: list[Pod] = []
        for pod in pods:
            cached = self._fresh(pod)
            if cached is not None:
                out[pod] = cached.names
            else:
                stale.append(pod)
        if stale:
            out.update(zip(stale, await asyncio.gather(*(self.listing(p) for p in stale)), strict=True))
        return out

    def capacity(self, pod: Pod) -> int | None:
        """How many adapters ``pod`` reported it can hold (None: unlimited or not listed yet)."""
        listing = self._listings.get(pod.uid)
        return listing.capacity if listing is not None else None

    def on_demand(self, pod: Pod) -> set[str]:
        """The adapters ``pod`` last listed as loaded on demand (unpinned)."""
        listing = self._listings.get(pod.uid)
        return listing.on_demand if listing is not None else set()

    def may_hold(self, pod: Pod, name: str) -> bool:
        """Whether ``pod`` was last seen holding ``name`` (pinned or on demand) or we loaded it there."""
        listing = self._listings.get(pod.uid)
        return (listing is not None and (name in listing.names or name in listing.on_demand)) or (
            pod.uid,
            name,
        ) in self._loaded

    def loaded_uri(self, pod: Pod, name: str) -> str | None:
        """The URI we loaded (or adopted) as ``name`` on ``pod``."""
        return self._loaded.get((pod.uid, name))

    def note(self, pod: Pod, name: str, uri: str | None) -> None:
        """``name`` is now loaded on ``pod`` from ``uri`` (None: unloaded)."""
        listing = self._listings.get(pod.uid)
        if listing:
            listing.on_demand.discard(name)  # a load pins it; an unload removes either kind
        if uri is None:
            self._loaded.pop((pod.uid, name), None)
            if listing:
                listing.names.discard(name)
        else:
            self._loaded[(pod.uid, name)] = uri
            if listing:
                listing.names.add(name)

    def adopt(self, pod: Pod, name: str, uri: str) -> None:
        """After an operator restart: trust a published status that ``pod`` serves ``uri`` as ``name``."""
        self._loaded[(pod.uid, name)] = uri

    async def unload_orphan(self, pod: Pod, name: str) -> bool:
        """Unload an adapter no DynamoModel stands for; True when it is gone."""
        try:
            await self.client.unload(pod.address(self.port), name)
        except WorkerError as e:
            log.warning("unloading orphan %s from pod %s failed: %s", name, pod.name, e)
            return False
        self.note(pod, name, None)
        return True
