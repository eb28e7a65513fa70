"""The disk cache of downloaded adapters: ``<root>/<key>`` directories with a byte cap and LRU eviction.

An entry is created by downloading into :meth:`DiskCache.new_temp` (under ``<root>/.tmp``, same
filesystem) and :meth:`DiskCache.commit`-ing it, an atomic rename. Before a download the caller
may :meth:`reserve` its expected size so the cap holds during the download too. Pinned entries
(adapters in the worker's CPU/GPU tiers) are never evicted (if the cap cannot be met without them:
:class:`SourceError` 507); entries just handed to a caller are leased briefly and evicted only as a
last resort. Thread-safe; every method blocks (call from a thread).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path

from .errors import SourceError
from .log import get_logger

log = get_logger(__name__)
_ENTRY = re.compile(r"^[a-z0-9]+_[0-9a-f]{32}$")


def dir_size(path: Path) -> int:
    """Total size in bytes of the regular files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class DiskCache:
    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.tmp_root = root / ".tmp"
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._pins: Counter[str] = Counter()
        self._reserved: dict[str, int] = {}
        self._leases: dict[str, float] = {}  # key -> monotonic expiry: just handed out, not yet pinned
        self.evictions = 0
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_root, ignore_errors=True)  # leftovers of a crash are never valid
        self.tmp_root.mkdir()
        found = [(p.stat().st_mtime, p.name, p) for p in root.iterdir() if p.is_dir() and _ENTRY.match(p.name)]
        for _mtime, name, path in sorted(found):
            self._entries[name] = dir_size(path)

    # -- queries ---------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> Path | None:
        """The entry's directory (marked most recently used), or None."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
        path = self.path(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order survives a restart
        return path

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, key: str) -> None:
        with self._lock:
            self._pins[key] += 1

    def unpin(self, key: str) -> None:
        with self._lock:
            if self._pins[key] > 0:
                self._pins[key] -= 1
            if self._pins[key] == 0:
                del self._pins[key]

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return self._pins[key] > 0

    def lease(self, key: str, seconds: float) -> None:
        """Evict ``key`` only as a last resort for ``seconds`` (a caller is about to read it, then pin it)."""
        with self._lock:
            now = time.monotonic()
            self._leases = {k: t for k, t in self._leases.items() if t > now}
            self._leases[key] = max(self._leases.get(key, 0.0), time.monotonic() + seconds)

    def _leased(self, key: str, now: float) -> bool:
        """(lock held) whether ``key`` holds an unexpired lease."""
        return self._leases.get(key, 0.0) > now

    # -- writing ---------------------------------------------------------------------------------

    def new_temp(self, key: str) -> Path:
        """A fresh empty directory to download ``key`` into."""
        return Path(tempfile.mkdtemp(prefix=f"{key}-", dir=self.tmp_root))

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def reserve(self, key: str, nbytes: int) -> None:
        """Make room for a download of about ``nbytes`` (evicting LRU unpinned entries); 507 if impossible."""
        with self._lock:
            self._reserved.pop(key, None)
            victims = self._plan_room(nbytes, exclude=key)
            self._reserved[key] = nbytes
        self._remove(victims)

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)

    def commit(self, key: str, tmp: Path) -> Path:
        """Move a complete download into place (replacing an older entry of the same key)."""
        size = dir_size(tmp)
        final = self.path(key)
        with self._lock:
            self._reserved.pop(key, None)
            try:
                victims = self._plan_room(size, exclude=key)
            except SourceError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            old = None
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix="old-", dir=self.tmp_root)) / key
                final.rename(old)
            tmp.rename(final)
            self._entries[key] = size
            self._entries.move_to_end(key)
        self._remove(victims)
        if old is not None:
            shutil.rmtree(old.parent, ignore_errors=True)
        return final

    def _plan_room(self, nbytes: int, exclude: str) -> list[Path]:
        """(lock held) Drop LRU unpinned entries from the index until ``nbytes`` more fit; return their dirs."""
        if self.max_bytes is None:
            return []
        used = sum(v for k, v in self._entries.items() if k != exclude) + sum(
            v for k, v in self._reserved.items() if k != exclude
        )
        if nbytes > self.max_bytes:
            raise SourceError(507, f"adapter needs {nbytes} bytes, more than the disk cache cap {self.max_bytes}")
        victims: list[str] = []
        now = time.monotonic()
        # First evict entries nobody is about to use; leased ones only if that is not enough.
        for soft in (True, False):
            for key, size in self._entries.items():
                if used + nbytes <= self.max_bytes:
                    break
                if key == exclude or key in victims or self._pins[key] > 0 or (soft and self._leased(key, now)):
                    continue
                victims.append(key)
                used -= size
        if used + nbytes > self.max_bytes:
            raise SourceError(507, f"disk cache full: {used} of {self.max_bytes} bytes held by adapters in use")
        paths = []
        for key in victims:
            size = self._entries.pop(key)
            self.evictions += 1
            # Rename first (atomic, under the lock) so a reader never sees a half-deleted entry.
            doomed = Path(tempfile.mkdtemp(prefix="evict-", dir=self.tmp_root)) / key
            self.path(key).rename(doomed)
            paths.append(doomed.parent)
            log.info("disk cache: evicted %s (%d bytes)", key, size)
        return paths

    def _remove(self, paths: list[Path]) -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
