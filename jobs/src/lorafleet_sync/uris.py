"""Adapter URIs (SPEC §5): parse, validate, canonicalise, and derive cache keys.

Three schemes:

- ``hf://org/repo[@revision]`` — a Hugging Face Hub repository (revision: branch, tag or commit SHA);
- ``s3://bucket[/prefix]`` — every object under ``prefix/`` in an S3/MinIO bucket;
- ``file:///abs/path`` — a local directory (confined to allowed roots by :mod:`lorafleet_sync.sources`).

Pure string handling: no network, no filesystem, no boto3 / huggingface_hub imports, so the
operator can use it freely. The sync job's output location for an ``hf://`` source is
:func:`synced_uri` (``s3://bucket[/prefix]/org/repo/sha``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

import blake3

__all__ = [
    "S3URI",
    "AdapterURI",
    "FileURI",
    "HfURI",
    "URIError",
    "cache_key",
    "is_commit_sha",
    "parse_uri",
    "synced_prefix",
    "synced_uri",
    "validate_relative_key",
]


class URIError(ValueError):
    """A malformed or unsafe adapter URI (maps to HTTP 400)."""


# Hugging Face repo names: letters, digits, '-', '_', '.'; no '--' or '..'; at most 96 characters.
_HF_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
# Git ref names we accept (branches, tags, 'refs/pr/N', commit SHAs).
_HF_REVISION = re.compile(r"^[A-Za-z0-9._/-]{1,255}$")
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
# S3 bucket names (AWS rules, also MinIO's).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class HfURI:
    """``hf://org/repo[@revision]``."""

    org: str
    repo: str
    revision: str | None = None

    scheme = "hf"

    @property
    def repo_id(self) -> str:
        return f"{self.org}/{self.repo}"

    def with_revision(self, revision: str) -> HfURI:
        return HfURI(self.org, self.repo, revision)

    def __str__(self) -> str:
        return f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class S3URI:
    """``s3://bucket[/prefix]``; ``prefix`` has no leading or trailing '/' ('' = whole bucket)."""

    bucket: str
    prefix: str = ""

    scheme = "s3"

    @property
    def key_prefix(self) -> str:
        """The prefix used for listing: ``prefix/`` (or '' for the whole bucket)."""
        return f"{self.prefix}/" if self.prefix else ""

    def child(self, *parts: str) -> S3URI:
        """This URI with path segments appended (each validated)."""
        joined = "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))
        return S3URI(self.bucket, _validate_s3_prefix(joined, f"s3://{self.bucket}/{joined}"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


@dataclass(frozen=True)
class FileURI:
    """``file:///abs/path`` (path as written, not yet resolved against the filesystem)."""

    path: str

    scheme = "file"

    def __str__(self) -> str:
        return "file://" + quote(self.path, safe="/@:+,=~!$&'()*;-._")


AdapterURI = HfURI | S3URI | FileURI


def parse_uri(uri: str) -> AdapterURI:
    """Parse and validate an adapter URI; raises :class:`URIError` with a readable message."""
    if not isinstance(uri, str) or not uri:
        raise URIError("adapter URI must be a non-empty string")
    if len(uri) > 2048:
        raise URIError("adapter URI is longer than 2048 characters")
    if _CONTROL.search(uri) or " " in uri.strip() or uri != uri.strip():
        raise URIError(f"adapter URI {uri!r} contains whitespace or control characters")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise URIError(f"adapter URI {uri!r} has no scheme; expected hf://, s3:// or file://")
    scheme = scheme.lower()
    if scheme == "hf":
        return _parse_hf(rest, uri)
    if scheme == "s3":
        return _parse_s3(rest, uri)
    if scheme == "file":
        return _parse_file(rest, uri)
    raise URIError(f"adapter URI {uri!r}: unsupported scheme {scheme!r}; expected hf://, s3:// or file://")


def _parse_hf(rest: str, uri: str) -> HfURI:
    path, at, revision = rest.partition("@")
    parts = path.split("/")
    if len(parts) != 2:
        raise URIError(f"{uri!r}: expected hf://org/repo[@revision]")
    for name in parts:
        if not _HF_NAME.match(name) or "--" in name or ".." in name:
            raise URIError(f"{uri!r}: invalid Hugging Face repository name part {name!r}")
    if at:
        if not _HF_REVISION.match(revision) or ".." in revision or revision.startswith("/") or revision.endswith("/"):
            raise URIError(f"{uri!r}: invalid revision {revision!r}")
        if "//" in revision:
            raise URIError(f"{uri!r}: invalid revision {revision!r}")
    return HfURI(parts[0], parts[1], revision if at else None)


def _parse_s3(rest: str, uri: str) -> S3URI:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise URIError(f"{uri!r}: invalid bucket name {bucket!r}")
    if prefix.startswith("/"):
        raise URIError(f"{uri!r}: object key prefix must not be absolute")
    return S3URI(bucket, _validate_s3_prefix(prefix.rstrip("/"), uri))


def _validate_s3_prefix(prefix: str, uri: str) -> str:
    if not prefix:
        return ""
    try:
        return validate_relative_key(prefix)
    except URIError as exc:
        raise URIError(f"{uri!r}: {exc}") from None


def validate_relative_key(key: str) -> str:
    """Validate a '/'-separated relative key (object key part or file path); return it unchanged.

    Refuses absolute keys, empty, '.' or '..' segments, backslashes and control characters.
    """
    if not key:
        raise URIError("empty key")
    if key.startswith("/"):
        raise URIError(f"absolute key {key!r} is not allowed")
    if "\\" in key or _CONTROL.search(key):
        raise URIError(f"key {key!r} contains a backslash or control characters")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise URIError(f"key {key!r} contains an empty, '.' or '..' segment")
    return key


def _parse_file(rest: str, uri: str) -> FileURI:
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost") or not slash:
        raise URIError(f"{uri!r}: expected file:///absolute/path")
    path = unquote("/" + path)
    if "\x00" in path or _CONTROL.search(path):
        raise URIError(f"{uri!r}: path contains control characters")
    if path != "/" and path.endswith("/"):
        path = path.rstrip("/")
    if any(seg in (".", "..") for seg in path.split("/")):
        raise URIError(f"{uri!r}: path must not contain '.' or '..' segments")
    return FileURI(path)


def is_commit_sha(revision: str | None) -> bool:
    """True for a full 40-hex git commit SHA."""
    return bool(revision and _COMMIT_SHA.match(revision))


def cache_key(uri: str | AdapterURI) -> str:
    """The cache directory name for a URI: ``<scheme>_<first 32 hex of BLAKE3(canonical uri)>``.

    For ``hf://`` the worker keys on the URI with the revision resolved to a commit SHA.
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    return f"{parsed.scheme}_{blake3.blake3(str(parsed).encode()).hexdigest()[:32]}"


def synced_prefix(source: HfURI, dest: S3URI) -> S3URI:
    """Where the sync job puts every revision of ``source``: ``s3://bucket[/prefix]/org/repo``."""
    return dest.child(source.org, source.repo)


def synced_uri(source: HfURI, dest: S3URI, sha: str) -> S3URI:
    """The sync job's output for ``source`` at commit ``sha``: ``s3://bucket[/prefix]/org/repo/sha``."""
    if not is_commit_sha(sha):
        raise URIError(f"{sha!r} is not a 40-hex commit SHA")
    return synced_prefix(source, dest).child(sha)
