"""Worker processes for tests, demos and benchmarks: start `lorafleet-worker serve` as a subprocess, wait for
`/ready`, stop it; and the demos' shared `--workdir` command line."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

READY_TIMEOUT_S = 300.0


class WorkerStartError(RuntimeError):
    """The worker exited or did not become ready in time."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch_worker(
    model_dir: Path,
    *,
    name: str,
    host: str,
    port: int,
    system_port: int,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log: IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `lorafleet-worker serve` (same interpreter) in its own session; does not wait."""
    cmd = [
        sys.executable,
        "-m",
        "lorafleet_worker",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--system-port",
        str(system_port),
        *args,
    ]
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )


def wait_ready(proc: subprocess.Popen[bytes], system_url: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Poll `/ready` until it answers 200; raise if the process exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise WorkerStartError(f"the worker exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{system_url}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise WorkerStartError(f"the worker was not ready after {timeout:.0f}s")
        time.sleep(0.2)


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, wait for a clean exit; SIGKILL only if it hangs. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def run_in_workdir(
    run: Callable[[Path], int], argv: Sequence[str] | None, *, description: str | None, workdir_help: str, prefix: str
) -> int:
    """A demo's command line: `--workdir DIR` (created if missing), else a temporary directory."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, help=f"{workdir_help} (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return run(args.workdir.resolve())
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        return run(Path(tmp))
