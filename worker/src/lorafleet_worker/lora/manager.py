"""AdapterManager: the worker's one adapter registry (names, versions for hot swap, where each came from), the
CPU tier (LRU) and the GPU slots (LRU + pins; there are `max_loras` of them, the only limit on adapters per step).

Life of an adapter version: `load` validates it and puts its weights in the CPU tier; `acquire`
takes a reference on the name's current version (a request takes it when it is submitted, so a later hot swap
does not change it, and the scheduler releases it when the request ends); `activate` puts the version in a GPU
slot and pins the slot. The version records its slot (the only record: refs and requests read it). A pinned
slot is never evicted. A version that was replaced (hot swap) or removed lives on until its last reference is
released.

Disk reads never happen under the manager's lock nor on the caller of `activate` (the engine step):
`load` reads before taking the lock, and a version whose weights the CPU tier dropped is read back by
a background thread that `weights_ready` starts; the step skips its requests until the weights are
there (`on_weights_ready` then wakes it), while every other request keeps decoding.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..host.omp_threads import serial
from .adapter import LoRAAdapter
from .errors import AdapterError, AdapterNotFoundError, CapacityError
from .pool import LoRAPool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Version:
    name: str
    version: int
    path: Path
    adapter: LoRAAdapter | None  # CPU-tier weights; None when the CPU tier dropped them
    refs: int = 0  # live AdapterRefs
    pins: int = 0  # activated AdapterRefs (pins `slot`)
    slot: int | None = None  # the GPU slot holding the weights: the one record of it (refs and requests read it)
    retired: bool = False  # replaced or removed: no new refs; freed when refs reaches 0
    reading: bool = False  # a background thread is reading the weights back from disk
    read_error: AdapterError | None = None  # the last background read failed
    content_hash: bytes = b""  # of the weights it was loaded with (prefix-cache identity)
    source: str = ""  # where it came from (the management API's URI; default: the path)


@dataclass(eq=False)
class AdapterRef:
    """A request's hold on one version of an adapter (hot-swap safe)."""

    name: str
    _version: _Version = field(repr=False)
    pinned: bool = False  # set by activate: the version's slot is pinned for this ref
    released: bool = False

    @property
    def version(self) -> int:
        return self._version.version

    @property
    def slot(self) -> int | None:
        """The GPU slot of this ref's version while the ref pins it (the version's slot is the only record)."""
        return self._version.slot if self.pinned else None

    @property
    def identity(self) -> bytes:
        """Name and weights' content hash: what KV computed with this version depends on (prefix caching)."""
        return self.name.encode() + b"\0" + self._version.content_hash


class AdapterManager:
    def __init__(
        self,
        config: ModelConfig,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_adapters: int | None = None,
        rank_major_b: bool | None = None,
    ) -> None:
        """`max_adapters` caps the number of registered names (None = unlimited; beyond it: CapacityError);
        `rank_major_b`: the pool's B layout (see `LoRAPool`)."""
        if max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be >= 1")
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.max_adapters = max_adapters
        self.dtype = dtype
        self.pool = LoRAPool(
            config, num_slots=max_loras, max_rank=max_lora_rank, device=device, dtype=dtype, rank_major_b=rank_major_b
        )
        self._lock = threading.RLock()
        self._registry: dict[str, _Version] = {}
        self._cpu: OrderedDict[int, _Version] = OrderedDict()  # version id -> version with weights, LRU first
        self._slots: list[_Version | None] = [None] * max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self._ids = itertools.count(1)
        self._counters = {"loads": 0, "reloads": 0, "evictions": 0, "cpu_evictions": 0, "removals": 0}
        self.on_weights_ready: Callable[[], None] | None = None  # called (on the reading thread) after a reload

    # ----- registry -------------------------------------------------------------------------------

    def load(self, name: str, path: Path, *, replace: bool = False, source: str | None = None) -> None:
        """Validate `path` and register it as `name` (blocking; call it off the event loop); `source`: where
        the files came from, as `sources()` reports it (default: the path).

        Same name and path again: no-op. Same name, other path: AdapterError unless `replace`
        (hot swap: new requests get the new weights, holders of the old version keep it).
        """
        path = Path(path)
        with self._lock:
            if self._admit(name, path, replace):
                return
        adapter = self._read(path)  # slow part, outside the lock
        with self._lock:
            if self._admit(name, path, replace):  # a concurrent load of the same name won
                return
            new = _Version(
                name, next(self._ids), path, adapter, content_hash=adapter.content_hash, source=source or str(path)
            )
            old = self._registry.get(name)
            self._registry[name] = new
            self._counters["loads"] += 1
            self._cpu_put(new)
            if old is not None:
                self._retire(old)

    def remove(self, name: str) -> None:
        """Drop `name` from the registry; its weights go once no reference holds them."""
        with self._lock:
            v = self._registry.pop(name, None)
            if v is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            self._counters["removals"] += 1
            self._retire(v)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registry)

    def path_of(self, name: str) -> Path | None:
        with self._lock:
            v = self._registry.get(name)
            return v.path if v is not None else None

    def source_of(self, name: str) -> str | None:
        """Where `name`'s current version came from; None when no adapter of that name is registered."""
        with self._lock:
            v = self._registry.get(name)
            return v.source if v is not None else None

    def in_flight(self, name: str) -> int:
        """How many requests hold `name`'s current version (0 when it is not registered)."""
        with self._lock:
            v = self._registry.get(name)
            return v.refs if v is not None else 0

    def sources(self) -> dict[str, str]:
        """Every registered name and where its current version came from, by name."""
        with self._lock:
            return {name: self._registry[name].source for name in sorted(self._registry)}

    # ----- request side ---------------------------------------------------------------------------

    def acquire(self, name: str) -> AdapterRef:
        """Hold the current version of `name`; AdapterNotFoundError if it is not registered."""
        with self._lock:
            v = self._registry.get(name)
            if v is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            v.refs += 1
            v.read_error = None  # a new request tries a failed read again
            return AdapterRef(name=name, _version=v)

    def weights_ready(self, ref: AdapterRef) -> bool:
        """True when `ref`'s weights are in memory (CPU tier or a slot). Otherwise start reading them back
        from disk in a background thread (once) and return False; AdapterError if that read failed."""
        with self._lock:
            v = ref._version
            if v.adapter is not None or v.slot is not None:
                return True
            if v.read_error is not None:
                raise v.read_error
            if not v.reading:
                v.reading = True
                read = serial(self._read_back)  # its torch ops on this thread alone: omp_threads.py
                threading.Thread(target=read, args=(v,), name=f"lora-read-{v.name}", daemon=True).start()
            return False

    def _read_back(self, v: _Version) -> None:
        """Background thread: read `v`'s weights from disk (no lock held), then put them in the CPU tier."""
        try:
            adapter: LoRAAdapter | None = self._read(v.path)
            error = None
        except AdapterError as e:
            adapter, error = None, e
        except Exception as e:  # a damaged file must fail its requests, not kill the thread silently
            log.exception("reading adapter %s back from %s failed", v.name, v.path)
            adapter, error = None, AdapterError(f"cannot read adapter {v.name!r} back: {type(e).__name__}: {e}")
        with self._lock:
            v.reading = False
            v.read_error = error
            if adapter is not None and v.refs > 0 and v.adapter is None:
                v.adapter = adapter
                self._counters["reloads"] += 1
                self._cpu_put(v)
        callback = self.on_weights_ready
        if callback is not None:
            callback()

    def activate(self, ref: AdapterRef) -> int | None:
        """Put `ref`'s version in a GPU slot and pin it; None when every slot is pinned, or when its
        weights are not in memory yet (see `weights_ready`, which the caller asks first).

        Idempotent per ref. Raises AdapterError if reading the weights back from disk failed.
        """
        with self._lock:
            if ref.released:
                raise ValueError(f"AdapterRef for {ref.name!r} was already released")
            v = ref._version
            if not ref.pinned:
                if v.slot is None:
                    if not self.weights_ready(ref):
                        return None
                    slot = self._free_slot()
                    if slot is None:
                        return None
                    self._install(v, slot)
                v.pins += 1
                ref.pinned = True
            assert v.slot is not None, "a pinned version keeps its slot"
            self._slot_lru.move_to_end(v.slot)
            return v.slot

    def release(self, ref: AdapterRef) -> None:
        """Unpin `ref`'s slot (if activated) and drop its hold on the version. Idempotent."""
        with self._lock:
            if ref.released:
                return
            ref.released = True
            v = ref._version
            if ref.pinned:
                v.pins -= 1
                ref.pinned = False
            v.refs -= 1
            if v.retired and v.refs == 0:
                self._free(v)

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "registered": len(self._registry),
                "slots_total": len(self._slots),
                "slots_used": sum(v is not None for v in self._slots),
                "slots_pinned": sum(v is not None and v.pins > 0 for v in self._slots),
                "cpu_resident": len(self._cpu),
                **self._counters,
            }

    def slot_of(self, name: str) -> int | None:
        """GPU slot of `name`'s current version, if resident."""
        with self._lock:
            v = self._registry.get(name)
            return v.slot if v is not None else None

    # ----- internals (lock held) ------------------------------------------------------------------

    def _read(self, path: Path) -> LoRAAdapter:
        return LoRAAdapter.load(path, self.config, self.max_lora_rank, dtype=self.dtype)

    def _admit(self, name: str, path: Path, replace: bool) -> bool:
        """Check that `name` may be (re)loaded from `path`; True when it is already loaded from it."""
        current = self._registry.get(name)
        if current is not None and not replace:
            if current.path == path:
                return True
            raise AdapterError(f"adapter {name!r} is already loaded from another path; unload it first")
        if current is None and self.max_adapters is not None and len(self._registry) >= self.max_adapters:
            raise CapacityError(f"cannot load {name!r}: {self.max_adapters} adapters are already loaded")
        return False

    def _cpu_put(self, v: _Version) -> None:
        self._cpu[v.version] = v
        self._cpu.move_to_end(v.version)
        while len(self._cpu) > self.max_cpu_loras:
            # A version some request waits on (held but not in a slot) keeps its weights: after a hot
            # swap or removal its files may be gone. Held versions are all in a pinned slot otherwise.
            victim = next((x for x in self._cpu.values() if x.refs == x.pins and x is not v), None)
            if victim is None:
                break
            del self._cpu[victim.version]
            victim.adapter = None
            self._counters["cpu_evictions"] += 1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used unpinned one; None if all are pinned."""
        for i, occupant in enumerate(self._slots):
            if occupant is None:
                return i
        for i in self._slot_lru:
            occupant = self._slots[i]
            if occupant is not None and occupant.pins == 0:
                return i
        return None

    def _install(self, v: _Version, slot: int) -> None:
        assert v.adapter is not None, "weights_ready() comes first"
        self._cpu.move_to_end(v.version)
        previous = self._slots[slot]
        if previous is not None:
            previous.slot = None
            self._counters["evictions"] += 1
        self.pool.write_slot(slot, v.adapter)
        self._slots[slot] = v
        v.slot = slot

    def _retire(self, v: _Version) -> None:
        v.retired = True
        if v.refs == 0:
            self._free(v)

    def _free(self, v: _Version) -> None:
        if v.slot is not None:
            self._slots[v.slot] = None
            self._slot_lru.move_to_end(v.slot, last=False)
            v.slot = None
        self._cpu.pop(v.version, None)
        v.adapter = None
