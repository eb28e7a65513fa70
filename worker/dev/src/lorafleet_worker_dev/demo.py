"""Single-worker demo: a tiny generated model, two PEFT adapters, one answer from each.

`python -m lorafleet_worker_dev.demo [--workdir DIR]` (or `make demo-worker`) generates the model and
adapters, starts `lorafleet-worker serve` as a subprocess, loads both adapters through the
management API, asks the base model and each adapter the same questions and prints what happened.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorafleet_worker_dev.launch import (
    WorkerStartError,
    free_port,
    launch_worker,
    run_in_workdir,
    stop_worker,
    wait_ready,
)
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model


def _call(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def run_demo(workdir: Path) -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0] if __doc__ else None
    return run_in_workdir(
        run_demo, argv, description=description, workdir_help="where to write the model, adapters and log",
        prefix="lorafleet-demo-",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
