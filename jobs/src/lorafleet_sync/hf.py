"""Hugging Face Hub access with ``huggingface_hub`` (``HF_ENDPOINT``, ``HF_TOKEN``), SPEC §5/§6.

:func:`resolve` turns ``hf://org/repo[@rev]`` into a commit SHA and the repo's file list;
:func:`download_files` fetches files at that SHA into a directory. Repository files whose path has
a segment starting with '.' (``.gitattributes``...) are not adapter files and are skipped.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SourceError
from .uris import HfURI, URIError, is_commit_sha, validate_relative_key

DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class HfSettings:
    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HfSettings:
        endpoint = (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        return cls(endpoint, env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None)

    def __repr__(self) -> str:  # never print the token
        return f"HfSettings(endpoint={self.endpoint!r}, token={'***' if self.token else None})"


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int | None


def _is_adapter_file(path: str) -> bool:
    return not any(part.startswith(".") for part in path.split("/"))


def resolve(settings: HfSettings, uri: HfURI, *, timeout: float = 30.0) -> tuple[str, list[HubFile]]:
    """(commit SHA, adapter files) of ``uri``'s revision (default branch ``main``)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=settings.endpoint, token=settings.token or False)
    try:
        info = api.model_info(uri.repo_id, revision=uri.revision or "main", files_metadata=True, timeout=timeout)
    except Exception as exc:
        raise classify(exc, str(uri)) from None
    sha = info.sha or ""
    if not is_commit_sha(sha):
        raise SourceError(502, f"{uri}: the hub returned no commit SHA for the revision", retryable=False)
    files = []
    for sibling in info.siblings or []:
        if not _is_adapter_file(sibling.rfilename):
            continue
        try:
            validate_relative_key(sibling.rfilename)
        except URIError as exc:
            raise SourceError(400, f"{uri}: refusing repository file: {exc}", retryable=False) from None
        files.append(HubFile(sibling.rfilename, sibling.size))
    if not files:
        raise SourceError(400, f"{uri}: repository has no files at {sha}")
    return sha, sorted(files, key=lambda f: f.path)


def download_files(
    settings: HfSettings,
    repo_id: str,
    sha: str,
    files: list[HubFile],
    dest: Path,
    *,
    label: str,
    timeout: float = 30.0,
    deadline: float | None = None,
    on_file: Callable[[str], None] | None = None,
) -> None:
    """Download ``files`` of ``repo_id`` at commit ``sha`` into ``dest`` (no hub metadata left behind).

    ``deadline`` (``time.monotonic()`` value) is checked between files: 504 once it has passed."""
    from huggingface_hub import hf_hub_download

    try:
        for f in files:
            if deadline is not None and time.monotonic() > deadline:
                raise SourceError(504, f"{label}: download deadline passed")
            hf_hub_download(
                repo_id,
                f.path,
                revision=sha,
                local_dir=dest,
                endpoint=settings.endpoint,
                token=settings.token or False,
                etag_timeout=timeout,
                tqdm_class=_silent_tqdm(),
            )
            if on_file is not None:
                on_file(f.path)
    except SourceError:
        raise
    except Exception as exc:
        raise classify(exc, label) from None
    finally:
        shutil.rmtree(dest / ".cache", ignore_errors=True)


def _silent_tqdm() -> Any:
    """A tqdm class that never draws (progress is logged per file instead)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Silent(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def classify(exc: BaseException, label: str) -> SourceError:
    """Map a huggingface_hub / HTTP exception (following its cause chain) to a SourceError."""
    from huggingface_hub import errors as he

    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for e in chain:
        if isinstance(e, SourceError):
            return e
        if isinstance(e, he.RevisionNotFoundError):
            return SourceError(400, f"{label}: revision not found on the hub")
        if isinstance(e, (he.RepositoryNotFoundError, he.RemoteEntryNotFoundError)):
            return SourceError(400, f"{label}: repository or file not found on the hub (or access denied)")
        if isinstance(e, he.HfHubHTTPError):
            status = e.response.status_code if e.response is not None else 0
            if status in (401, 403):
                return SourceError(502, f"{label}: the hub refused our token (HTTP {status})", retryable=False)
            if status == 404:
                return SourceError(400, f"{label}: not found on the hub")
            if status >= 500 or status in (408, 429):
                return SourceError(502, f"{label}: hub error HTTP {status}")
            return SourceError(502, f"{label}: hub error HTTP {status}", retryable=False)
        name = type(e).__name__
        if "Timeout" in name:
            return SourceError(504, f"{label}: hub timed out ({name})")
        if name in ("ConnectError", "RemoteProtocolError", "ReadError", "NetworkError", "ConnectionError") or (
            isinstance(e, ConnectionError)
        ):
            return SourceError(502, f"{label}: hub unreachable ({name})")
    if isinstance(exc, OSError):
        return SourceError(502, f"{label}: {type(exc).__name__}: {exc}")
    return SourceError(502, f"{label}: unexpected hub error {type(exc).__name__}: {exc}", retryable=False)
