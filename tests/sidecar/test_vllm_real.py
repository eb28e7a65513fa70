"""The sidecar driving a real vLLM server (vLLM's CPU build, `make vllm`) with the real SmolLM2-135M-Instruct and
the demo's trained PEFT adapters, copied into a real MinIO: load through the management API, a chat answer through
vLLM with the adapter, a hot swap under the same name, unload.

vLLM takes minutes to start on a small CPU, so this runs only under `make e2e-vllm` (LORAFLEET_VLLM_E2E=1).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lorafleet_devcluster.minio import MinioServer, free_port, wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.environ.get("LORAFLEET_VLLM_E2E") != "1", reason="real vLLM: run `make e2e-vllm`"),
]

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = Path(sys.executable).parent / "lorafleet-vllm-sidecar"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def http(method: str, url: str, body: Any = None, timeout: float = 300) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status == 200
    return False


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer (exit {proc.poll()}); log:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)  # polling a server that is starting: nothing to wait on but its port


def test_sidecar_drives_real_vllm(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from bench import vllm_server
    from demo.real_model import SERVED_NAME, prepare_model
    from demo.train_adapters import trained_adapters

    if not vllm_server.PYTHON.is_file():
        pytest.fail(f"vLLM is not installed at {vllm_server.PYTHON}: run `make vllm`")
    model, adapters = prepare_model(), trained_adapters()
    minio = MinioServer(tmp_path / "minio").start()
    try:
        bucket = minio.make_bucket()
        for style in ("french", "pirate"):
            minio.upload_dir(bucket, f"adapters/{style}", adapters[style])
        vllm_port, system_port = free_port(), free_port()
        vllm_url, sidecar_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{system_port}"
        cmd = vllm_server.server_command(model, [], port=vllm_port, dtype="float32", max_num_seqs=4, max_model_len=512)
        cmd[cmd.index("base")] = SERVED_NAME
        cmd += ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16"]
        cpus = sorted(os.sched_getaffinity(0))
        vllm_env = {**os.environ, **vllm_server.server_env("nobind", cpus, 1)}  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
        sidecar_env = {**os.environ, **minio.env(), "DYN_LORA_PATH": str(tmp_path / "loras")}
        sidecar_cmd = [str(SIDECAR), "--vllm-url", vllm_url, "--host", "127.0.0.1", "--system-port", str(system_port)]
        sidecar_cmd += ["--max-loaded-loras", "2"]
        with (
            process(cmd, vllm_env, tmp_path / "vllm.log") as vllm,
            process(sidecar_cmd, sidecar_env, tmp_path / "sidecar.log") as sidecar,
        ):
            wait_until(lambda: answers(f"{sidecar_url}/health"), 30, "the sidecar's /health")
            assert not answers(f"{sidecar_url}/ready"), "ready before vLLM answers"
            wait_for(vllm, f"{vllm_url}/health", vllm_server.START_TIMEOUT_S, tmp_path / "vllm.log")
            wait_for(sidecar, f"{sidecar_url}/ready", 30, tmp_path / "sidecar.log")

            def ask(name: str) -> tuple[int, str]:
                body = {"model": name, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
                status, data = http("POST", f"{vllm_url}/v1/chat/completions", body)
                return status, data["choices"][0]["message"]["content"] if status == 200 else json.dumps(data)

            base = ask(SERVED_NAME)
            assert base[0] == 200 and "Paris" in base[1], base

            status, body = http(
                "POST",
                f"{sidecar_url}/v1/loras",
                {"lora_name": "style", "source": {"uri": f"s3://{bucket}/adapters/french"}},
            )
            assert status == 200 and body["message"] == "LoRA adapter 'style' loaded successfully", body
            listing = http("GET", f"{sidecar_url}/v1/loras")[1]
            assert (listing["count"], listing["capacity"], listing["pinned"]) == (1, 2, {"style": True}), listing
            french = ask("style")
            assert french[0] == 200 and "capitale" in french[1].lower(), french
            models = http("GET", f"{vllm_url}/v1/models")[1]["data"]
            style = next(m for m in models if m["id"] == "style")
            assert style["parent"] == SERVED_NAME and style["root"].startswith(str(tmp_path / "loras")), style

            status, body = http(
                "POST",
                f"{sidecar_url}/v1/loras",
                {"lora_name": "style", "source": {"uri": f"s3://{bucket}/adapters/pirate"}},
            )
            assert status == 200 and body["message"] == "LoRA adapter 'style' swapped successfully", body
            pirate = ask("style")
            assert pirate[0] == 200 and "arr" in pirate[1].lower() and pirate[1] != french[1], pirate

            status, body = http("DELETE", f"{sidecar_url}/v1/loras/style")
            assert status == 200, body
            assert ask("style")[0] == 404
            assert http("GET", f"{sidecar_url}/v1/loras")[1]["loras"] == {}
            assert ask(SERVED_NAME) == base
            print(f"vLLM via the sidecar: base {base[1]!r}; french {french[1]!r}; pirate {pirate[1]!r}")
    finally:
        minio.close()
