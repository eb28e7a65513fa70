"""``lorafleet-manifest.json`` (SPEC §6) and validation of an adapter directory (SPEC §5).

The sync job writes the manifest last, next to the adapter files::

    {"format": "lorafleet-manifest/v1", "source": "hf://org/repo@<sha>", "sha": "<sha>",
     "files": [{"path": "adapter_config.json", "size": 123, "sha256": "..."}, ...]}

A fetched directory is valid when it has ``adapter_config.json`` and weights, and, when a manifest
is present, exactly the listed files with the listed sizes and SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import SourceError
from .uris import URIError, validate_relative_key

MANIFEST_NAME = "lorafleet-manifest.json"
MANIFEST_FORMAT = "lorafleet-manifest/v1"
CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    source: str
    sha: str
    files: list[FileEntry] = field(default_factory=list)
    format: str = MANIFEST_FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = sorted(data["files"], key=lambda f: f["path"])
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate a manifest; raises ValueError on anything malformed."""
        data: Any = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} document")
        files = data.get("files")
        if not isinstance(files, list):
            raise ValueError("'files' must be a list")
        entries = []
        for item in files:
            if not isinstance(item, dict):
                raise ValueError("file entries must be objects")
            path, size, digest = item.get("path"), item.get("size"), item.get("sha256")
            if not isinstance(path, str) or not isinstance(size, int) or not isinstance(digest, str):
                raise ValueError(f"malformed file entry {item!r}")
            try:
                validate_relative_key(path)
            except URIError as exc:
                raise ValueError(f"unsafe path in manifest: {exc}") from None
            if path == MANIFEST_NAME or size < 0 or len(digest) != 64:
                raise ValueError(f"malformed file entry {item!r}")
            entries.append(FileEntry(path, size, digest.lower()))
        return cls(source=str(data.get("source", "")), sha=str(data.get("sha", "")), files=entries)

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}


def sha256_file(path: Path) -> str:
    """Streaming SHA-256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(root: Path, rel: str) -> FileEntry:
    path = root / rel
    return FileEntry(rel, path.stat().st_size, sha256_file(path))


def list_files(root: Path) -> list[str]:
    """Relative '/'-paths of the regular files under ``root`` (symlinks are refused)."""
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise SourceError(400, f"adapter directory contains a symlink: {path.relative_to(root).as_posix()}")
        if path.is_file():
            out.append(path.relative_to(root).as_posix())
    return out


def validate_adapter_dir(root: Path, label: str) -> None:
    """Check that ``root`` is a usable adapter directory; SourceError(400) naming the problem.

    ``label`` (the URI) is used in messages. Blocking: call from a thread.
    """
    if not root.is_dir():
        raise SourceError(400, f"{label}: not a directory")
    if not (root / CONFIG_NAME).is_file():
        raise SourceError(400, f"{label}: missing {CONFIG_NAME}")
    if not any((root / name).is_file() for name in WEIGHT_NAMES):
        raise SourceError(400, f"{label}: missing adapter weights ({' or '.join(WEIGHT_NAMES)})")
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_file():
        verify_manifest(root, manifest_path, label)


def verify_manifest(root: Path, manifest_path: Path, label: str) -> None:
    """Every file must match the manifest (size, sha256); no unlisted files allowed."""
    try:
        manifest = Manifest.from_json(manifest_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(400, f"{label}: invalid {MANIFEST_NAME}: {exc}") from None
    expected = manifest.by_path()
    present = set(list_files(root)) - {MANIFEST_NAME}
    unlisted = sorted(present - expected.keys())
    if unlisted:
        raise SourceError(400, f"{label}: file {unlisted[0]} is not listed in {MANIFEST_NAME}")
    for rel, entry in sorted(expected.items()):
        if rel not in present:
            raise SourceError(400, f"{label}: file {rel} listed in {MANIFEST_NAME} is missing")
        size = (root / rel).stat().st_size
        if size != entry.size:
            raise SourceError(400, f"{label}: integrity check failed for {rel}: size {size} != {entry.size}")
        if sha256_file(root / rel) != entry.sha256:
            raise SourceError(400, f"{label}: integrity check failed for {rel}: sha256 mismatch")
