"""A real MinIO server for tests: loopback address, free ports, its own data dir, an audit trail.

The binary is built by ``make minio`` (``mk/minio.mk``) into
``$LORAFLEET_CACHE/bin/minio-<version>``; ``LORAFLEET_MINIO_BIN`` overrides it. MinIO sends an
audit record of every S3 call to a webhook served here (:class:`AuditLog`), so tests can count
``GetObject`` calls; :meth:`MinioServer.sync_audit` waits until every earlier call is recorded.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from lorafleet_devcluster.paths import REPO_ROOT


def minio_version() -> str:
    """The pinned version, read from ``mk/minio.mk`` (defined once there)."""
    text = (REPO_ROOT / "mk" / "minio.mk").read_text()
    match = re.search(r"^MINIO_VERSION \?= (\S+)$", text, re.M)
    assert match, "MINIO_VERSION not found in mk/minio.mk"
    return match.group(1)


def minio_binary() -> Path:
    if override := os.environ.get("LORAFLEET_MINIO_BIN"):
        return Path(override)
    cache = Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet"))
    return cache / "bin" / f"minio-{minio_version()}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``predicate`` until true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _record_time(record: dict[str, Any]) -> tuple[str, str]:
    """Sortable form of an audit record's RFC 3339 time (nanosecond fractions of varying length)."""
    whole, _, fraction = str(record.get("time", "")).rstrip("Z").partition(".")
    return whole, fraction.ljust(9, "0")


class AuditLog:
    """Receives MinIO's audit webhook: one JSON record per S3 API call."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        log = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                for line in body.splitlines():
                    if line.strip():
                        with log._lock:
                            log.records.append(json.loads(line))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="minio-audit", daemon=True).start()
        self.url = f"http://{host}:{self._server.server_address[1]}/"

    def calls(self, api: str, bucket: str | None = None, prefix: str = "") -> list[dict[str, Any]]:
        """Records of API ``api`` (e.g. 'GetObject'), optionally for a bucket and object-key prefix,
        in the order MinIO handled them."""
        with self._lock:
            records = list(self.records)
        out = []
        for rec in records:
            info = rec.get("api", {})
            if info.get("name") != api:
                continue
            if bucket is not None and info.get("bucket") != bucket:
                continue
            if not str(info.get("object", "")).startswith(prefix):
                continue
            out.append(rec)
        return sorted(out, key=_record_time)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class MinioServer:
    """``start()`` / ``stop()`` (restartable on the same ports and data) / ``env()`` for AWS_* variables."""

    def __init__(self, data_dir: Path, *, host: str = "127.0.0.1", binary: Path | None = None) -> None:
        self.binary = binary or minio_binary()
        if not self.binary.is_file():
            raise RuntimeError(f"MinIO binary {self.binary} not found: run `make minio` (or `make setup`) first")
        self.data_dir = data_dir
        self.host = host
        self.port = free_port(host)
        self.console_port = free_port(host)
        self.access_key = "lorafleet-test"
        self.secret_key = secrets.token_hex(16)
        self.audit = AuditLog(host)
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS_* variables a client needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60.0) -> MinioServer:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("MINIO_", "AWS_"))},
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
            "MINIO_AUDIT_WEBHOOK_ENABLE_tests": "on",
            "MINIO_AUDIT_WEBHOOK_ENDPOINT_tests": self.audit.url,
            "MINIO_AUDIT_WEBHOOK_BATCH_SIZE_tests": "1",
        }
        cmd = [
            str(self.binary), "server", "--quiet", "--address", f"{self.host}:{self.port}",
            "--console-address", f"{self.host}:{self.console_port}", str(self.data_dir),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout, f"MinIO on {self.url} (log: {self.log_path})", interval=0.1)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"MinIO exited with {self.proc.returncode}; see {self.log_path}")
        try:
            with urllib.request.urlopen(f"{self.url}/minio/health/ready", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGKILL: like a crash; connections drop at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self.audit.close()

    # -- helpers --------------------------------------------------------------------------------

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> None:
        client = self.client()
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(directory).as_posix()}")

    def sync_audit(self, bucket: str, timeout: float = 20.0) -> None:
        """Wait until MinIO delivered the audit records of every call made before this one."""
        marker = f"audit-marker-{uuid.uuid4().hex}"
        self.client().put_object(Bucket=bucket, Key=marker, Body=b"")
        wait_until(lambda: bool(self.audit.calls("PutObject", bucket, marker)), timeout, "the audit marker")
