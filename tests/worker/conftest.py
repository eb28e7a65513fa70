"""Real `lorafleet-worker serve` subprocesses on their own 127.0.0.x address, for the HTTP tests."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_worker.config import ModelConfig
from lorafleet_worker_dev.launch import WorkerStartError, free_port, launch_worker, wait_ready
from lorafleet_worker_dev.launch import stop_worker as stop_process

READY_TIMEOUT_S = float(os.environ.get("LORAFLEET_TEST_READY_TIMEOUT_S", "300"))
ADMIN_TOKEN = "test-admin-token-0123456789"

_hosts = itertools.count((os.getpid() * 7) % 200)


def _free_host() -> str:
    """A loopback address of its own (127.0.0.20 - 127.0.0.219), so that workers never share ports."""
    return f"127.0.0.{20 + next(_hosts) % 200}"


@dataclass
class Worker:
    """A running worker subprocess and where to reach it."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    system_port: int
    model_name: str
    log_path: Path
    admin_token: str | None
    file_root: Path
    model_dir: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def system_url(self) -> str:
        return f"http://{self.host}:{self.system_port}"

    def admin_headers(self, token: str | None = None) -> dict[str, str]:
        token = token if token is not None else self.admin_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def load(self, name: str, path: Path | str, *, expect: int = 200) -> dict[str, Any]:
        """`POST /v1/loras` with a file:// URI (or a URI as given); asserts the status."""
        uri = path if isinstance(path, str) else f"file://{path}"
        r = httpx.post(
            f"{self.system_url}/v1/loras",
            json={"lora_name": name, "source": {"uri": uri}},
            headers=self.admin_headers(),
            timeout=120,
        )
        assert r.status_code == expect, f"load {name}: {r.status_code} {r.text}"
        body: dict[str, Any] = r.json()
        return body

    def unload(self, name: str, *, expect: int = 200) -> dict[str, Any]:
        r = httpx.delete(f"{self.system_url}/v1/loras/{name}", headers=self.admin_headers(), timeout=120)
        assert r.status_code == expect, f"unload {name}: {r.status_code} {r.text}"
        body: dict[str, Any] = r.json()
        return body

    def loras(self) -> dict[str, int]:
        r = httpx.get(f"{self.system_url}/v1/loras", headers=self.admin_headers(), timeout=30)
        assert r.status_code == 200, r.text
        loras: dict[str, int] = r.json()["loras"]
        return loras

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {sample name with labels: value}."""
        r = httpx.get(f"{self.system_url}/metrics", timeout=30)
        assert r.status_code == 200
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def complete(self, model: str, prompt: Any, **kw: Any) -> dict[str, Any]:
        body = {"model": model, "prompt": prompt, "temperature": 0, **kw}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, f"{r.status_code} {r.text}"
        out: dict[str, Any] = r.json()
        return out

    def is_alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.system_url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False


def wait_until(condition: Callable[[], bool], timeout: float, message: str, interval: float = 0.05) -> None:
    """Poll `condition` until it holds; fail with `message` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s: {message}")
        time.sleep(interval)


def start_worker(
    model_dir: Path,
    workdir: Path,
    *,
    name: str = "tiny",
    admin_token: str | None = None,
    args: list[str] | None = None,
    file_root: Path | None = None,
) -> Worker:
    """Start `lorafleet-worker serve` and wait for `/ready`; file:// adapters are allowed under `file_root`."""
    host = _free_host()
    port, system_port = free_port(host), free_port(host)
    workdir.mkdir(parents=True, exist_ok=True)
    file_root = file_root or workdir / "adapters"
    file_root.mkdir(parents=True, exist_ok=True)
    env = {
        "LORAFLEET_FILE_ROOTS": str(file_root),
        "DYN_LORA_PATH": str(workdir / "lora-cache"),
        "LORAFLEET_ADMIN_TOKEN": "",
    }
    args = list(args or [])
    if admin_token:
        token_file = workdir / "admin-token"
        token_file.write_text(admin_token + "\n")
        args += ["--admin-token-file", str(token_file)]
    log_path = workdir / "worker.log"
    with log_path.open("wb") as log:
        proc = launch_worker(
            model_dir, name=name, host=host, port=port, system_port=system_port, args=args, env=env, log=log
        )
    worker = Worker(proc, host, port, system_port, name, log_path, admin_token, file_root, model_dir)
    try:
        wait_ready(proc, worker.system_url, READY_TIMEOUT_S)
    except WorkerStartError as e:
        stop_worker(worker)
        pytest.fail(f"{e}:\n{worker.log_tail()}")
    return worker


def use_local_s3(env: pytest.MonkeyPatch, endpoint: str, fetch_deadline_s: float) -> None:
    """Point the S3 client of workers started under `env` at `endpoint` (static test keys, no profile, config
    file or instance metadata), with a short fetch deadline."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_PROFILE"):
        env.delenv(name, raising=False)
    env.setenv("AWS_ENDPOINT_URL", endpoint)
    env.setenv("AWS_ALLOW_HTTP", "true")
    env.setenv("AWS_ACCESS_KEY_ID", "test-access-key")
    env.setenv("AWS_SECRET_ACCESS_KEY", "test-secret-key")
    env.setenv("AWS_CONFIG_FILE", "/nonexistent")
    env.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    env.setenv("AWS_EC2_METADATA_DISABLED", "true")
    env.setenv("LORAFLEET_FETCH_DEADLINE_S", str(fetch_deadline_s))


def stop_worker(worker: Worker) -> None:
    """SIGTERM, wait for a clean exit, SIGKILL only if it hangs."""
    stop_process(worker.proc)


@pytest.fixture(scope="session")
def shared_worker(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One llama worker for the API / openai / error / concurrency tests: admin token on, 4 GPU slots."""
    worker = start_worker(
        tiny_models["llama"],
        tmp_path_factory.mktemp("shared_worker"),
        name="tiny-llama",
        admin_token=ADMIN_TOKEN,
        args=["--max-loras", "4", "--max-cpu-loras", "32", "--max-lora-rank", "64"],
    )
    yield worker
    stop_worker(worker)
    assert worker.proc.returncode == 0, f"worker did not exit cleanly:\n{worker.log_tail()}"


@pytest.fixture(scope="session")
def place_adapter(shared_worker: Worker) -> Callable[[Path, str], Path]:
    """Copy an adapter directory under the shared worker's allowed root; returns the copy."""

    def place(src: Path, name: str) -> Path:
        dst = shared_worker.file_root / name
        if not dst.exists():
            shutil.copytree(src, dst)
        return dst

    return place


def load_error(worker: Worker, name: str, uri: str, status: int, headers: dict[str, str] | None = None) -> str:
    """POST /v1/loras expecting `status`; checks the Dynamo error body and that nothing got loaded."""
    r = httpx.post(
        f"{worker.system_url}/v1/loras",
        json={"lora_name": name, "source": {"uri": uri}},
        headers=worker.admin_headers() if headers is None else headers,
        timeout=120,
    )
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == "error" and body["message"], body
    assert name not in worker.loras()
    message: str = body["message"]
    return message


@pytest.fixture(scope="module")
def config(tiny_models: Any) -> ModelConfig:
    """The tiny llama's config (scheduler and KV-cache tests)."""
    return ModelConfig.from_dir(tiny_models["llama"])


@pytest.fixture(scope="session")
def trained_adapters() -> dict[str, Path]:
    """The demo's trained adapters on the real model (demo.train_adapters; trained here, minutes on a CPU,
    when this machine's cache lacks them): style -> PEFT directory."""
    from demo.train_adapters import trained_adapters as train_missing

    return train_missing()
