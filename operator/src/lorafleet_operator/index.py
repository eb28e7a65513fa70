"""The operator's one index of DynamoModels: each object once (its body and its parsed form
together), and who owns each served name.

Every writer goes through ``apply``/``remove``: the watch, and the answers of our own writes
(status, finalizers), so a status the operator just wrote is what ``owner``, the drift pass and
the next reconcile read, without waiting for the watch to echo it.

Name ownership: among live LoRA DynamoModels with the same (base model, ``modelName``) the
oldest (creationTimestamp, then namespace/name) owns the name. A change of who claims a name
calls ``on_claim_change`` for every claimant of it (they re-reconcile: one of them may now own it).
Every write calls ``on_change(old, new)`` (None for an object that appeared or went), for what is
derived from the objects (the workers' catalogues: ``catalog.Catalogs``); ``catalog`` reads one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet_operator.resources import Model

Key = tuple[str, str]
ServedName = tuple[str, str]  # (base-model hash, modelName)


@dataclass(frozen=True)
class _Entry:
    body: dict[str, Any]
    model: Model


def key_of(body: Mapping[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return (meta.get("namespace", ""), meta.get("name", ""))


class ModelIndex:
    """DynamoModels by (namespace, name), and the live LoRA claimants of each served name."""

    def __init__(
        self,
        on_claim_change: Callable[[Key], None] = lambda _k: None,
        on_change: Callable[[Model | None, Model | None], None] = lambda _old, _new: None,
    ) -> None:
        self._entries: dict[Key, _Entry] = {}
        self._claimants: defaultdict[ServedName, set[Key]] = defaultdict(set)
        self._on_claim_change = on_claim_change
        self._on_change = on_change

    # ---- writes -------------------------------------------------------------------------
    def apply(self, body: Mapping[str, Any]) -> tuple[Model | None, Model]:
        """Store the newest version of an object; returns (the version it replaced, the new one)."""
        key = key_of(body)
        old = self._entries.get(key)
        model = Model.from_body(body)
        self._entries[key] = _Entry(dict(body), model)
        self._claim(key, old.model if old else None, model)
        self._on_change(old.model if old else None, model)
        return (old.model if old else None, model)

    def refresh(self, body: Mapping[str, Any] | None) -> None:
        """The answer of one of our writes to an object: kept if the object is still indexed (same uid)."""
        if body is None:
            return
        old = self._entries.get(key_of(body))
        if old is not None and old.model.uid == (body.get("metadata") or {}).get("uid", old.model.uid):
            self.apply(body)

    def remove(self, key: Key) -> Model | None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._claim(key, old.model, None)
            self._on_change(old.model, None)
        return old.model if old else None

    def _claim(self, key: Key, old: Model | None, new: Model | None) -> None:
        before = old.served_name if old is not None and old.is_lora and not old.deleting else None
        after = new.served_name if new is not None and new.is_lora and not new.deleting else None
        if before == after:
            return
        for name in (before, after):
            if name is None:
                continue
            if name == before:
                self._claimants[name].discard(key)
            else:
                self._claimants[name].add(key)
            for other in self._claimants[name]:
                self._on_claim_change(other)
            if not self._claimants[name]:
                del self._claimants[name]

    # ---- reads --------------------------------------------------------------------------
    def get(self, key: Key) -> Model | None:
        entry = self._entries.get(key)
        return entry.model if entry else None

    def body(self, key: Key) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        return entry.body if entry else None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._entries))  # a copy: callers may change the index meanwhile

    def items(self) -> Iterator[tuple[Key, Model]]:
        return ((k, e.model) for k, e in self._entries.items())

    def owner(self, model: Model) -> Model | None:
        """The oldest live DynamoModel claiming ``model``'s served name (None if there is none)."""
        keys = self._claimants.get(model.served_name)
        if not keys:
            return None
        live = (self._entries[k].model for k in keys if k in self._entries)
        return min(live, key=lambda m: m.seniority, default=None)

    def owners(self) -> list[tuple[Key, Model]]:
        """The live LoRA DynamoModels that own their served name."""
        return [(k, m) for k, m in self.items() if m.is_lora and not m.deleting and self.owner(m) is m]

    def wanted(self, namespace: str, base_hash: str, name: str) -> bool:
        """Whether a live LoRA DynamoModel in ``namespace`` claims ``name`` for that base model."""
        return any(k[0] == namespace for k in self._claimants.get((base_hash, name), ()))

    def loras_of(self, namespace: str, base_hash: str | None) -> list[tuple[Key, Model]]:
        """Live LoRA DynamoModels of one base model in one namespace."""
        return [
            (k, m)
            for k, m in self.items()
            if k[0] == namespace and m.is_lora and not m.deleting and m.base_hash == base_hash
        ]

    def catalog(self, namespace: str, base_hash: str) -> list[tuple[str, str]]:
        """The workers' catalogue of one base model in one namespace: (modelName, URI) of every
        LoRA DynamoModel that owns its name and has a version to load (``Model.catalog_uri``), by name."""
        out = []
        for _key, model in self.loras_of(namespace, base_hash):
            uri = model.catalog_uri
            if uri is not None and self.owner(model) is model:
                out.append((model.model_name, uri))
        return sorted(out)

    def bases_of(self, namespace: str, base_hash: str | None) -> list[Key]:
        """Base-model DynamoModels (they list every pod of their base model)."""
        return [k for k, m in self.items() if k[0] == namespace and not m.is_lora and m.base_hash == base_hash]
