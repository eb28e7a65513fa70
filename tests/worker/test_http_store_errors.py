"""SPEC §3's store and capacity errors through the real HTTP API: 502 (store refuses connections),
504 (store stalls mid-download), 507 (`--max-loaded-loras` reached); the worker keeps serving."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import pytest
from lorafleet_worker_dev.launch import free_port

from tests.worker.conftest import Worker, load_error, start_worker, stop_worker, use_local_s3

STORE_HOST = "127.0.0.1"
FETCH_DEADLINE_S = 2.0
MAX_LOADED = 2


@pytest.fixture(scope="module")
def store_port() -> int:
    """The port of the worker's S3 endpoint: nothing listens there unless a test starts a store."""
    return free_port(STORE_HOST)


@pytest.fixture(scope="module")
def worker(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory, store_port: int) -> Iterator[Worker]:
    """A worker with at most MAX_LOADED adapters, whose S3 endpoint is `store_port`, with a short fetch deadline."""
    with pytest.MonkeyPatch.context() as env:
        use_local_s3(env, f"http://{STORE_HOST}:{store_port}", FETCH_DEADLINE_S)
        w = start_worker(
            tiny_models["llama"],
            tmp_path_factory.mktemp("store_errors_worker"),
            name="tiny-llama",
            args=["--max-loaded-loras", str(MAX_LOADED)],
        )
    yield w
    stop_worker(w)
    assert w.proc.returncode == 0, f"worker did not exit cleanly:\n{w.log_tail()}"


@pytest.fixture(autouse=True)
def still_serving(worker: Worker) -> Iterator[None]:
    """After each error, the worker still answers inference and management calls."""
    yield
    assert worker.proc.poll() is None, worker.log_tail()
    assert worker.complete("tiny-llama", "Hello", max_tokens=2)["usage"]["completion_tokens"] >= 1
    worker.loras()


class _StallingS3(BaseHTTPRequestHandler):
    """Lists two objects under any prefix, serves adapter_config.json, then stalls mid-way through the weights."""

    server: _StoreServer

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        self.server.requests.append(path)
        if "list-type" in query:
            prefix = query.get("prefix", [""])[0]
            items = "".join(
                f'<Contents><Key>{prefix}{key}</Key><Size>{size}</Size><ETag>"0"</ETag>'
                "<LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>"
                for key, size in (("adapter_config.json", 2), ("adapter_model.safetensors", 4096))
            )
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>adapters</Name><Prefix>{prefix}</Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys>"
                f"<IsTruncated>false</IsTruncated>{items}</ListBucketResult>"
            ).encode()
            self._headers(len(body), "application/xml")
            self.wfile.write(body)
        elif path.endswith("/adapter_config.json"):
            self._headers(2, "application/json")
            self.wfile.write(b"{}")
        else:  # the weights: a first part, then silence until the test ends
            self._headers(4096, "application/octet-stream")
            self.wfile.write(b"\0" * 512)
            self.wfile.flush()
            self.server.release.wait(timeout=120)

    def _headers(self, length: int, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _StoreServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _StallingS3)
        self.requests: list[str] = []
        self.release = threading.Event()


@contextmanager
def stalling_store(port: int) -> Iterator[_StoreServer]:
    """A real HTTP S3 endpoint on `port` that stalls object downloads; stopped (port free again) on exit."""
    server = _StoreServer((STORE_HOST, port))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def _assert_no_partial_download(worker: Worker) -> None:
    """The download cache ($DYN_LORA_PATH) holds no entry and no temp directory after a failed fetch."""
    cache = worker.log_path.parent / "lora-cache"
    leftovers = [p for p in cache.rglob("*") if p != cache / ".tmp"] if cache.exists() else []
    assert leftovers == [], leftovers


def test_store_refusing_connections_is_502(worker: Worker) -> None:
    uri = "s3://adapters/refused/v1/"
    message = load_error(worker, "refused", uri, 502)
    assert uri.rstrip("/") in message and "unreachable" in message, message
    _assert_no_partial_download(worker)


def test_store_stalling_mid_download_is_504(worker: Worker, store_port: int) -> None:
    uri = "s3://adapters/stalled/v1/"
    with stalling_store(store_port) as store:
        message = load_error(worker, "stalled", uri, 504)
        assert "/adapters/stalled/v1/adapter_model.safetensors" in store.requests, store.requests
    assert uri.rstrip("/") in message and "timed out" in message, message
    _assert_no_partial_download(worker)


@pytest.fixture(scope="module")
def adapters(worker: Worker, tiny_models: Any, tiny_adapter_factory: Any) -> list[Path]:
    """MAX_LOADED + 1 distinct adapters under the worker's allowed file root."""
    out = []
    for seed in range(MAX_LOADED + 1):
        src: Path = tiny_adapter_factory(tiny_models["llama"], rank=4, seed=70 + seed)
        dst = worker.file_root / f"cap-{seed}"
        if not dst.exists():
            shutil.copytree(src, dst)
        out.append(dst)
    return out


def test_more_adapters_than_max_loaded_loras_is_507(worker: Worker, adapters: list[Path]) -> None:
    first, second, third = adapters
    worker.load("cap-a", first)
    worker.load("cap-b", second)
    r = httpx.post(
        f"{worker.system_url}/v1/loras",
        json={"lora_name": "cap-c", "source": {"uri": f"file://{third}"}},
        timeout=120,
    )
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["status"] == "error" and "cap-c" in body["message"] and str(MAX_LOADED) in body["message"], body
    assert set(worker.loras()) == {"cap-a", "cap-b"}
    listing = httpx.get(f"{worker.system_url}/v1/loras", headers=worker.admin_headers()).json()
    assert (listing["count"], listing["capacity"]) == (2, MAX_LOADED)  # what the operator places by

    assert "already loaded" in worker.load("cap-a", first)["message"]  # idempotent: no new slot needed
    out = worker.complete("cap-b", "Hello", max_tokens=2)
    assert out["usage"]["completion_tokens"] >= 1

    worker.unload("cap-b")
    worker.load("cap-c", third)
    assert set(worker.loras()) == {"cap-a", "cap-c"}
    assert worker.complete("cap-c", "Hello", max_tokens=2)["usage"]["completion_tokens"] >= 1
    for name in ("cap-a", "cap-c"):
        worker.unload(name)
