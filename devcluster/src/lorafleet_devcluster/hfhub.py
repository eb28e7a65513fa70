"""A small local Hugging Face Hub-compatible HTTP endpoint for tests (used via ``HF_ENDPOINT``).

Repositories live in a directory: ``<root>/<org>/<repo>/commits/<sha>/<files>`` plus
``refs.json`` (branches and tags → commit SHA). :meth:`LocalHub.commit` adds a commit and moves a
branch. Served, as the real ``huggingface_hub`` client requests them (checked with the client):

- ``GET /api/models/{org}/{repo}[/revision/{rev}]`` (``model_info``/``repo_info``; ``?blobs=True`` adds sizes)
- ``GET /api/models/{org}/{repo}/tree/{rev}[/{path}]`` (``list_repo_tree``/``list_repo_files``/``snapshot_download``)
- ``GET /api/models/{org}/{repo}/refs`` (``list_repo_refs``)
- ``HEAD|GET /{org}/{repo}/resolve/{rev}/{path}`` (``hf_hub_download``; ``Range`` supported)

Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) so
the client raises its usual exceptions. With ``token`` set, every request needs
``Authorization: Bearer <token>``. With ``failing_downloads`` set to a status (e.g. 503), file
downloads answer it while the metadata endpoints keep working (a storage outage behind the Hub).
``downloads`` counts file GETs; ``requests`` logs every request.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import socket
import threading
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SHA = re.compile(r"^[0-9a-f]{40}$")


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LocalHub:
    """Start with :meth:`start` (or as a context manager); ``url`` is the ``HF_ENDPOINT`` value."""

    def __init__(self, root: Path, *, token: str | None = None, host: str = "127.0.0.1") -> None:
        self.root = root
        self.token = token
        self.host = host
        self.downloads: Counter[str] = Counter()  # "org/repo/path" -> file GETs
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.failing_downloads: int | None = None  # while set, file downloads answer this status (an outage)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0  # chosen on the first start, kept for restarts
        self._conns: set[socket.socket] = set()
        root.mkdir(parents=True, exist_ok=True)

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.port, "hub not started"
        return f"http://{self.host}:{self.port}"

    def start(self) -> LocalHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self.port = int(self._server.server_address[1])
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hf-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop open (keep-alive) connections, like a server going down."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- repositories -----------------------------------------------------------------------------

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id

    def commit(
        self, repo_id: str, files: Path | Mapping[str, bytes], *, branch: str = "main", tags: tuple[str, ...] = ()
    ) -> str:
        """Add a commit with exactly ``files`` (a directory or {path: bytes}); move ``branch`` (and
        ``tags``) to it; return its SHA."""
        contents = _read_files(files) if isinstance(files, Path) else dict(files)
        refs = self.refs(repo_id)
        parent = refs["branches"].get(branch, "")
        digest = hashlib.sha1(parent.encode())
        for path in sorted(contents):
            digest.update(path.encode() + b"\0" + hashlib.sha256(contents[path]).digest())
        sha = digest.hexdigest()
        commit_dir = self.repo_dir(repo_id) / "commits" / sha
        if not commit_dir.exists():
            tmp = commit_dir.with_name(sha + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            for path, data in contents.items():
                (tmp / path).parent.mkdir(parents=True, exist_ok=True)
                (tmp / path).write_bytes(data)
            tmp.rename(commit_dir)
        refs["branches"][branch] = sha
        for tag in tags:
            refs["tags"][tag] = sha
        self._write_refs(repo_id, refs)
        return sha

    def set_ref(self, repo_id: str, name: str, sha: str, *, kind: str = "branches") -> None:
        refs = self.refs(repo_id)
        refs[kind][name] = sha
        self._write_refs(repo_id, refs)

    def refs(self, repo_id: str) -> dict[str, dict[str, str]]:
        path = self.repo_dir(repo_id) / "refs.json"
        if not path.exists():
            return {"branches": {}, "tags": {}}
        data: dict[str, dict[str, str]] = json.loads(path.read_text())
        return data

    def _write_refs(self, repo_id: str, refs: dict[str, dict[str, str]]) -> None:
        path = self.repo_dir(repo_id) / "refs.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(refs, indent=1))
        tmp.replace(path)

    def resolve(self, repo_id: str, revision: str) -> str | None:
        """Commit SHA of a branch, tag or (existing) SHA; None when unknown."""
        refs = self.refs(repo_id)
        if revision in refs["branches"]:
            return refs["branches"][revision]
        if revision in refs["tags"]:
            return refs["tags"][revision]
        if _SHA.match(revision) and (self.repo_dir(repo_id) / "commits" / revision).is_dir():
            return revision
        return None

    def repo_exists(self, repo_id: str) -> bool:
        return (self.repo_dir(repo_id) / "refs.json").is_file()

    def files(self, repo_id: str, sha: str) -> dict[str, Path]:
        base = self.repo_dir(repo_id) / "commits" / sha
        return {p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file()}

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def _count_download(self, key: str) -> None:
        with self._lock:
            self.downloads[key] += 1


def _read_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _file_meta(path: str, file: Path) -> dict[str, Any]:
    data = file.read_bytes()
    meta: dict[str, Any] = {"path": path, "size": len(data), "oid": _git_blob_sha(data)}
    if path.endswith(_LFS_SUFFIXES):
        meta["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return meta


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._conns.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._conns.discard(self.connection)
        super().finish()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    # -- routing ----------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self.hub._record(method, split.path)
        query = parse_qs(split.query)
        parts = [unquote(p) for p in split.path.split("/")[1:]]
        try:
            self._check_auth()
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = f"{parts[2]}/{parts[3]}"
                rest = parts[4:]
                if not rest:
                    return self._model_info(repo_id, "main", query)
                if rest[0] == "revision" and len(rest) >= 2:
                    return self._model_info(repo_id, "/".join(rest[1:]), query)
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo_id, rest[1], "/".join(rest[2:]), query)
                if rest == ["refs"]:
                    return self._list_refs(repo_id)
            if len(parts) >= 5 and parts[2] == "resolve":
                if self.hub.failing_downloads is not None:
                    raise _HubError(self.hub.failing_downloads, None, "file downloads are failing (test outage)")
                return self._resolve(method, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
            raise _HubError(404, None, f"no route for {split.path}")
        except _HubError as err:
            self._send_error(err)

    def _check_auth(self) -> None:
        if self.hub.token is None:
            return
        header = self.headers.get("Authorization")
        if not header:
            raise _HubError(401, "RepoNotFound", "Repository not found")
        if header != f"Bearer {self.hub.token}":
            raise _HubError(401, None, "Invalid credentials in Authorization header")

    def _sha_or_error(self, repo_id: str, revision: str) -> str:
        if not self.hub.repo_exists(repo_id):
            raise _HubError(404, "RepoNotFound", "Repository not found")
        sha = self.hub.resolve(repo_id, revision)
        if sha is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    # -- endpoints --------------------------------------------------------------------------------

    def _model_info(self, repo_id: str, revision: str, query: dict[str, list[str]]) -> None:
        sha = self._sha_or_error(repo_id, revision)
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path, file in self.hub.files(repo_id, sha).items():
            if blobs:
                meta = _file_meta(path, file)
                sibling: dict[str, Any] = {"rfilename": path, "size": meta["size"], "blobId": meta["oid"]}
                if "lfs" in meta:
                    lfs = meta["lfs"]
                    sibling["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
                siblings.append(sibling)
            else:
                siblings.append({"rfilename": path})
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        info = {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": sha,
            "lastModified": now,
            "createdAt": now,
            "private": self.hub.token is not None,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["peft"],
            "library_name": "peft",
            "siblings": siblings,
        }
        self._send_json(info)

    def _tree(self, repo_id: str, revision: str, path: str, query: dict[str, list[str]]) -> None:
        sha = self._sha_or_error(repo_id, revision)
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{path.rstrip('/')}/" if path else ""
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for rel, file in self.hub.files(repo_id, sha).items():
            if not rel.startswith(prefix):
                continue
            sub = rel[len(prefix) :]
            if "/" in sub and not recursive:
                folders.add(prefix + sub.split("/")[0])
                continue
            segments = sub.split("/")
            folders.update(prefix + "/".join(segments[:i]) for i in range(1, len(segments)))
            entries.append({"type": "file", **_file_meta(rel, file)})
        if path and not entries and not folders:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        dirs = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "path": f} for f in sorted(folders)]
        self._send_json(dirs + entries)

    def _list_refs(self, repo_id: str) -> None:
        if not self.hub.repo_exists(repo_id):
            raise _HubError(404, "RepoNotFound", "Repository not found")
        refs = self.hub.refs(repo_id)

        def items(kind: str) -> list[dict[str, str]]:
            prefix = "refs/heads/" if kind == "branches" else "refs/tags/"
            return [{"name": n, "ref": prefix + n, "targetCommit": s} for n, s in sorted(refs[kind].items())]

        self._send_json({"branches": items("branches"), "tags": items("tags"), "converts": []})

    def _resolve(self, method: str, repo_id: str, revision: str, path: str) -> None:
        sha = self._sha_or_error(repo_id, revision)
        file = self.hub.files(repo_id, sha).get(path)
        if file is None:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        data = file.read_bytes()
        meta = _file_meta(path, file)
        etag = meta["lfs"]["oid"] if "lfs" in meta else meta["oid"]
        start, status = 0, 200
        range_header = self.headers.get("Range")
        if range_header and (m := re.fullmatch(r"bytes=(\d+)-", range_header.strip())):
            start, status = min(int(m.group(1)), len(data)), 206
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", sha)
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if method == "GET":
            self.hub._count_download(f"{repo_id}/{path}")
            self.wfile.write(body)

    # -- responses --------------------------------------------------------------------------------

    def _send_json(self, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error(self, err: _HubError) -> None:
        body = json.dumps({"error": err.message}).encode()
        self.send_response(err.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if err.code:
            self.send_header("X-Error-Code", err.code)
        self.send_header("X-Error-Message", err.message)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
