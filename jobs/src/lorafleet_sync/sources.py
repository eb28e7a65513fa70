"""Adapter sources for the worker (SPEC §5): ``file://``, ``s3://`` and ``hf://`` into a local directory.

``AdapterSources.fetch(uri)`` returns a directory with ``adapter_config.json`` and weights:

- ``file://`` directories are used in place, only under the allowed roots (after resolving symlinks);
- ``s3://`` and ``hf://`` are downloaded into the disk cache (:mod:`lorafleet_sync.cache`) at
  ``<cache_dir>/<scheme>_<32 hex>``, through a temp dir renamed into place, one download per URI at a
  time, retried with exponential backoff until a total deadline; ``hf://`` revisions are resolved to a
  commit SHA first and the cache is keyed on the resolved URI.

Every failure is a :class:`SourceError` carrying the HTTP status for the management API.
Blocking work (filesystem, network) runs in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import hf, s3
from .cache import DiskCache
from .errors import SourceError
from .log import get_logger
from .manifest import validate_adapter_dir
from .retry import FetchPolicy, retry_async
from .uris import S3URI, AdapterURI, FileURI, HfURI, URIError, cache_key, is_commit_sha, parse_uri

__all__ = ["AdapterSources", "FetchPolicy", "SourceError"]

log = get_logger(__name__)


def _parse_roots(value: str) -> list[Path]:
    return [Path(p) for chunk in value.split(os.pathsep) for p in chunk.split(",") if p.strip()]


class AdapterSources:
    """Fetches adapters by URI into local directories (see module docstring)."""

    def __init__(
        self,
        *,
        cache_dir: Path | None,
        file_roots: list[Path],
        cache_max_bytes: int | None = None,
        policy: FetchPolicy | None = None,
        s3_settings: s3.S3Settings | None = None,
        hf_settings: hf.HfSettings | None = None,
    ) -> None:
        if cache_dir is None:
            cache_dir = Path(tempfile.mkdtemp(prefix="lorafleet-lora-cache-"))
        self.cache = DiskCache(Path(cache_dir), cache_max_bytes)
        self.file_roots = [Path(os.path.realpath(r)) for r in file_roots]
        self.policy = policy or FetchPolicy()
        self.s3_settings = s3_settings or s3.S3Settings.from_env()
        self.hf_settings = hf_settings or hf.HfSettings.from_env()
        self._inflight: dict[str, asyncio.Future[Path]] = {}
        self._resolved: dict[str, str] = {}  # canonical uri -> cache key (hf: after resolving the revision)
        self._pinned: dict[str, list[str]] = {}  # canonical uri -> keys pinned through it (unpin pops)
        self.lease_s = 60.0  # a fetched entry is not evicted for this long, so the caller can read/pin it
        self.stats = {"fetches": 0, "downloads": 0, "cache_hits": 0, "retries": 0}
        self.on_file: Callable[[str, str], None] | None = None  # (uri, relative path) after each downloaded file

    @classmethod
    def from_env(cls, cache_dir: Path | None = None) -> AdapterSources:
        """Settings from the environment: ``DYN_LORA_PATH`` (cache dir), ``LORAFLEET_FILE_ROOTS``
        (``:`` or ``,`` separated), ``LORAFLEET_CACHE_MAX_BYTES``, ``LORAFLEET_FETCH_DEADLINE_S``;
        S3 and Hub settings are the standard ``AWS_*`` and ``HF_*`` variables."""
        env = os.environ
        if cache_dir is None and env.get("DYN_LORA_PATH"):
            cache_dir = Path(env["DYN_LORA_PATH"])
        max_bytes = env.get("LORAFLEET_CACHE_MAX_BYTES")
        return cls(
            cache_dir=cache_dir,
            file_roots=_parse_roots(env.get("LORAFLEET_FILE_ROOTS", "")),
            cache_max_bytes=int(max_bytes) if max_bytes else None,
            policy=FetchPolicy.from_env(env),
        )

    # -- public API -------------------------------------------------------------------------------

    async def fetch(self, uri: str, *, pin: bool = False) -> Path:
        """A local directory with the adapter at ``uri``; ``pin=True`` also pins its cache entry."""
        self.stats["fetches"] += 1
        parsed = _parse(uri)
        if isinstance(parsed, FileURI):
            return await asyncio.to_thread(self._fetch_file, parsed)
        canonical = str(parsed)
        future = self._inflight.get(canonical)
        if future is None:
            future = asyncio.ensure_future(self._fetch_remote(parsed))
            self._inflight[canonical] = future
            future.add_done_callback(lambda _f: self._inflight.pop(canonical, None))
        path = await asyncio.shield(future)
        self.cache.lease(path.name, self.lease_s)
        if pin:
            self._pin_key(canonical, path.name)
        return path

    def pin(self, uri: str) -> None:
        """Never evict the cache entry of ``uri`` (counted; no-op for ``file://``).

        For ``hf://`` this is the commit the last fetch resolved; a later :meth:`unpin` of the same
        URI releases that same entry even if the branch has moved since."""
        parsed = _parse(uri)
        if not isinstance(parsed, FileURI):
            self._pin_key(str(parsed), self._resolved.get(str(parsed)) or cache_key(parsed))

    def _pin_key(self, canonical: str, key: str) -> None:
        self._pinned.setdefault(canonical, []).append(key)
        self.cache.pin(key)

    def unpin(self, uri: str) -> None:
        parsed = _parse(uri)
        keys = self._pinned.get(str(parsed))
        if not keys:
            return
        self.cache.unpin(keys.pop(0))
        if not keys:
            del self._pinned[str(parsed)]

    # -- internals --------------------------------------------------------------------------------

    def _fetch_file(self, uri: FileURI) -> Path:
        if not self.file_roots:
            raise SourceError(400, f"{uri}: file:// adapters are disabled (LORAFLEET_FILE_ROOTS is empty)")
        real = Path(os.path.realpath(uri.path))
        if not any(real == root or real.is_relative_to(root) for root in self.file_roots):
            raise SourceError(400, f"{uri}: path is outside the allowed roots (LORAFLEET_FILE_ROOTS)")
        if not real.exists():
            raise SourceError(400, f"{uri}: no such directory")
        _check_no_escaping_symlinks(real, self.file_roots, str(uri))
        validate_adapter_dir(real, str(uri))
        return real

    async def _fetch_remote(self, uri: S3URI | HfURI) -> Path:
        """Download with retries (exponential backoff) until the policy's total deadline."""
        deadline = self.policy.start()

        def retried() -> None:
            self.stats["retries"] += 1

        return await retry_async(
            lambda: asyncio.to_thread(self._fetch_once, uri, deadline), self.policy, f"fetch {uri}", on_retry=retried
        )

    def _fetch_once(self, uri: S3URI | HfURI, deadline: float) -> Path:
        """One attempt (in a thread): cache hit, or download into a temp dir, validate, commit."""
        timeouts = self._timeouts(deadline)
        label = str(uri)
        if isinstance(uri, S3URI):
            key = cache_key(uri)
            if (hit := self._hit(key)) is not None:
                return hit
            client = s3.call(label, lambda: self.s3_settings.client(**timeouts))
            objects = s3.call(label, lambda: s3.list_objects(client, uri))
            if not objects:
                raise SourceError(400, f"{uri}: no objects under this prefix")
            expected = sum(o.size for o in objects)

            def download(tmp: Path) -> None:
                s3.download_objects(client, uri, objects, tmp, deadline=deadline, on_file=self._observer(label))

        else:
            if is_commit_sha(uri.revision) and (hit := self._hit(cache_key(uri))) is not None:
                self._resolved[label] = cache_key(uri)
                return hit
            sha, files = hf.resolve(self.hf_settings, uri, timeout=timeouts["read_timeout"])
            resolved = uri.with_revision(sha)
            key = self._resolved[label] = cache_key(resolved)
            if (hit := self._hit(key)) is not None:
                return hit
            expected = sum(f.size or 0 for f in files)
            label = str(resolved)

            def download(tmp: Path) -> None:
                hf.download_files(
                    self.hf_settings, uri.repo_id, sha, files, tmp, label=label,
                    timeout=timeouts["read_timeout"], deadline=deadline, on_file=self._observer(label),
                )  # fmt: skip

        self.cache.reserve(key, expected)
        tmp = self.cache.new_temp(key)
        try:
            s3.call(label, lambda: download(tmp))
            validate_adapter_dir(tmp, label)
            path = self.cache.commit(key, tmp)
        except BaseException:
            self.cache.discard(tmp)
            self.cache.release(key)
            raise
        self.stats["downloads"] += 1
        log.info("fetched %s into %s", label, path)
        return path

    def _hit(self, key: str) -> Path | None:
        path = self.cache.get(key)
        if path is not None:
            self.stats["cache_hits"] += 1
        return path

    def _timeouts(self, deadline: float) -> dict[str, float]:
        remaining = max(0.1, deadline - time.monotonic())
        return {
            "connect_timeout": min(self.policy.connect_timeout_s, remaining),
            "read_timeout": min(self.policy.read_timeout_s, remaining),
        }

    def _observer(self, label: str) -> Callable[[str], None] | None:
        hook = self.on_file
        return None if hook is None else (lambda rel: hook(label, rel))


def _parse(uri: str) -> AdapterURI:
    try:
        return parse_uri(uri)
    except URIError as exc:
        raise SourceError(400, str(exc)) from None


def _check_no_escaping_symlinks(root: Path, allowed: list[Path], label: str) -> None:
    """Refuse a directory holding symlinks that resolve outside the allowed roots."""
    for path in root.rglob("*"):
        if path.is_symlink():
            target = Path(os.path.realpath(path))
            if not any(target == r or target.is_relative_to(r) for r in allowed):
                raise SourceError(400, f"{label}: {path.relative_to(root)} is a symlink leaving the allowed roots")
