"""The sync job (SPEC §6): copy a Hugging Face adapter into S3/MinIO under its commit SHA.

``hf://org/repo[@rev]`` → ``s3://<bucket>[/<prefix>]/<org>/<repo>/<sha>/`` (the destination's prefix,
if any, comes first). Steps: resolve the revision to a commit SHA; if the destination already
holds a manifest for that SHA whose objects all match (size and ``x-amz-meta-sha256``), do nothing;
otherwise download the files, upload those that differ, delete stray objects, and write
``lorafleet-manifest.json`` last. Idempotent: re-running after a failure finishes the job.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial
from pathlib import Path
from typing import Any

from . import hf, s3
from .errors import SourceError
from .log import get_logger
from .manifest import MANIFEST_NAME, FileEntry, Manifest, file_entry, validate_adapter_dir
from .uris import S3URI, HfURI, synced_uri

log = get_logger(__name__)


class ExitCode(IntEnum):
    """Process exit codes of ``lorafleet-sync`` (sysexits.h)."""

    OK = 0
    USAGE = 64  # EX_USAGE: bad command line (malformed --source/--dest)
    PERMANENT = 65  # EX_DATAERR: no such repo/revision/bucket, not an adapter, credentials refused
    SOFTWARE = 70  # EX_SOFTWARE: unexpected internal error (a bug)
    RETRYABLE = 75  # EX_TEMPFAIL: hub or object store unreachable, timed out, or 5xx; try again later


def exit_code_for(err: SourceError) -> ExitCode:
    return ExitCode.RETRYABLE if err.retryable else ExitCode.PERMANENT


@dataclass
class SyncResult:
    uri: S3URI
    sha: str
    uploaded: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    manifest_written: bool = False


def sync(
    source: HfURI,
    dest: S3URI,
    *,
    hf_settings: hf.HfSettings,
    s3_settings: s3.S3Settings,
    timeout: float = 30.0,
) -> SyncResult:
    """Run one sync (see module docstring). Raises SourceError (``retryable`` tells the exit code)."""
    sha, files = hf.resolve(hf_settings, source, timeout=timeout)
    target = synced_uri(source, dest, sha)
    log.info("resolved %s to commit %s (%d files); destination %s", source, sha, len(files), target)
    client = s3_settings.client(connect_timeout=min(timeout, 10.0), read_timeout=timeout)
    result = SyncResult(target, sha)
    label = str(target)

    existing = _read_manifest(client, target)
    if existing is not None and _up_to_date(client, target, existing, sha, files):
        result.unchanged = [e.path for e in existing.files]
        log.info("up to date: %s already holds all %d files and the manifest", target, len(files))
        return result

    with tempfile.TemporaryDirectory(prefix="lorafleet-sync-") as tmp:
        workdir = Path(tmp)
        total = len(files)
        counter = iter(range(1, total + 1))
        hf.download_files(
            hf_settings, source.repo_id, sha, files, workdir, label=f"{source.with_revision(sha)}", timeout=timeout,
            on_file=lambda rel: log.info("downloaded %s (%d/%d)", rel, next(counter), total),
        )  # fmt: skip
        validate_adapter_dir(workdir, str(source))
        entries = [file_entry(workdir, f.path) for f in files]
        for i, entry in enumerate(entries, 1):
            if s3.call(label, partial(_object_matches, client, target, entry)):
                result.unchanged.append(entry.path)
                log.info("unchanged %s (%d/%d, %d bytes)", entry.path, i, total, entry.size)
                continue
            key = target.key_prefix + entry.path
            s3.call(label, partial(s3.upload_file, client, target.bucket, key, workdir / entry.path, entry.sha256))
            result.uploaded.append(entry.path)
            log.info(
                "uploaded %s (%d/%d, %d bytes) to s3://%s/%s", entry.path, i, total, entry.size, target.bucket, key
            )

    keep = {e.path for e in entries} | {MANIFEST_NAME}
    for obj in s3.call(label, lambda: s3.list_objects(client, target)):
        if obj.rel not in keep:
            s3.call(label, partial(client.delete_object, Bucket=target.bucket, Key=obj.key))
            result.deleted.append(obj.rel)
            log.info("deleted stray object %s", obj.key)

    manifest = Manifest(source=str(source.with_revision(sha)), sha=sha, files=entries)
    if existing is None or existing.to_json() != manifest.to_json() or result.uploaded or result.deleted:
        body = manifest.to_json().encode()
        s3.call(label, lambda: s3.put_bytes(client, target.bucket, target.key_prefix + MANIFEST_NAME, body))
        result.manifest_written = True
        log.info("wrote %s (%d files)", MANIFEST_NAME, len(entries))
    return result


def _read_manifest(client: Any, target: S3URI) -> Manifest | None:
    data = s3.call(str(target), lambda: s3.get_bytes(client, target.bucket, target.key_prefix + MANIFEST_NAME))
    if data is None:
        return None
    try:
        return Manifest.from_json(data)
    except (ValueError, UnicodeDecodeError) as exc:
        log.warning("ignoring unreadable %s at %s: %s", MANIFEST_NAME, target, exc)
        return None


def _up_to_date(client: Any, target: S3URI, existing: Manifest, sha: str, files: list[hf.HubFile]) -> bool:
    """The destination's manifest is for ``sha``, lists exactly ``files``, and every object matches it."""
    if existing.sha != sha or {f.path for f in existing.files} != {f.path for f in files}:
        return False
    return all(s3.call(str(target), partial(_object_matches, client, target, e)) for e in existing.files)


def _object_matches(client: Any, target: S3URI, entry: FileEntry) -> bool:
    found = s3.head(client, target.bucket, target.key_prefix + entry.path)
    return found is not None and found[0] == entry.size and found[1].get(s3.SHA256_META) == entry.sha256
