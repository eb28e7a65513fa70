"""Single-worker demo: a tiny generated model, two PEFT adapters, one answer from each.

`python -m lorafleet_worker.demo [--workdir DIR]` (or `make demo-worker`) generates the model and
adapters, starts `lorafleet-worker serve` as a subprocess, loads both adapters through the
management API, asks the base model and each adapter the same questions and prints what happened.
`launch_worker` / `wait_ready` are also used by the tests to run real worker processes.
"""

from __future__ import annotations

import argparse
import json
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
from typing import IO, Any

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


def _call(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def run_demo(workdir: Path) -> int:
    from lorafleet_worker.devtools import make_tiny_adapter, make_tiny_model

    print(f"==> generating a tiny llama model and two LoRA adapters in {workdir}")
    model_dir = workdir / "tiny-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, "llama")
    adapters = {"demo/storyteller": (8, 1), "demo/poet": (16, 2)}
    paths = {}
    for name, (rank, seed) in adapters.items():
        path = workdir / "adapters" / name.replace("/", "-")
        if not (path / "adapter_config.json").exists():
            make_tiny_adapter(path, model_dir, rank=rank, seed=seed)
        paths[name] = path

    host = "127.0.0.1"
    port, system_port = free_port(host), free_port(host)
    url, system_url = f"http://{host}:{port}", f"http://{host}:{system_port}"
    log_path = workdir / "worker.log"
    print(f"==> starting lorafleet-worker serve (inference {url}, management {system_url}, log {log_path})")
    with log_path.open("wb") as log:
        proc = launch_worker(
            model_dir,
            name="tiny-llama",
            host=host,
            port=port,
            system_port=system_port,
            args=["--max-loras", "2"],
            env={"LORAFLEET_FILE_ROOTS": str(workdir / "adapters"), "DYN_LORA_PATH": str(workdir / "cache")},
            log=log,
        )
    try:
        wait_ready(proc, system_url)
        print("==> worker ready")
        for name, path in paths.items():
            status, body = _call(
                "POST", f"{system_url}/v1/loras", {"lora_name": name, "source": {"uri": f"file://{path}"}}
            )
            print(f"POST /v1/loras {name} -> {status} {json.dumps(body)}")
            if status != 200:
                return 1
        status, body = _call("GET", f"{system_url}/v1/loras")
        print(f"GET /v1/loras -> {status} {json.dumps(body)}")
        prompt = "Once upon a time there was a little robot"
        for model in ["tiny-llama", *paths]:
            status, body = _call(
                "POST", f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            )
            if status != 200:
                print(f"{model}: error {status} {body}")
                return 1
            print(f"[{model}] {prompt!r} -> {body['choices'][0]['text']!r}")
            status, body = _call(
                "POST",
                f"{url}/v1/chat/completions",
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "Hello!"}],
                    "max_tokens": 12,
                    "temperature": 0,
                },
            )
            print(f"[{model}] chat 'Hello!' -> {body['choices'][0]['message']['content']!r}")
        print("==> done (the tiny model has random weights: the answers are gibberish, but each adapter's differs)")
        return 0
    except WorkerStartError as e:
        print(f"error: {e}\n{log_path.read_text(errors='replace')[-4000:]}", file=sys.stderr)
        return 1
    finally:
        stop_worker(proc)


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


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0] if __doc__ else None
    return run_in_workdir(
        run_demo, argv, description=description, workdir_help="where to write the model, adapters and log",
        prefix="lorafleet-demo-",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
