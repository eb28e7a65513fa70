"""NVIDIA's `aiperf` profiling a worker: chat streaming with a LoRA model name, output lengths pinned.

Benchmark clients pin output lengths with `ignore_eos` or `min_tokens`; both must give every request
exactly the asked length, with zero errors. The `min_tokens` run also biases EOS to the top
(`logit_bias`), so without `min_tokens` every answer would be one token long.

aiperf pins its own dependencies (some conflict with constraints.txt), so it runs from its own venv
under $LORAFLEET_CACHE, installed on first use from the pinned `aiperf-requirements.txt`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worker.conftest import Worker, start_worker, stop_worker
from tests.worker.test_http_gateway_metrics import scrape, total

REQUIREMENTS = Path(__file__).with_name("aiperf-requirements.txt")
ADAPTER = "bench/r8"
REQUESTS = 8
OUTPUT_TOKENS = 12
AIPERF_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def aiperf() -> Path:
    """The `aiperf` executable, from a venv keyed by the requirements' hash (installed once per machine)."""
    cache = Path(os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache" / "lorafleet")
    venv = cache / f"aiperf-{hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]}"
    stamp = venv / ".installed"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "aiperf.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time; the others then find it installed
        if not stamp.is_file():
            shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from an interrupted run
            uv = str(Path(sys.executable).with_name("uv"))
            env = {**os.environ, "UV_CACHE_DIR": str(cache / "uv")}
            subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
            install = [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "-r", str(REQUIREMENTS)]
            subprocess.run(install, check=True, env=env)
            stamp.touch()
    return venv / "bin" / "aiperf"


@pytest.fixture(scope="module")
def worker(tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    adapter = tiny_adapter_factory(tiny_models["llama"], rank=8, seed=41)
    w = start_worker(
        tiny_models["llama"],
        tmp_path_factory.mktemp("aiperf_worker"),
        name="tiny-bench",
        file_root=Path(adapter).parent,
        args=["--max-loras", "2"],
    )
    try:
        w.load(ADAPTER, adapter)
        yield w
    finally:
        stop_worker(w)


def _eos(worker: Worker) -> int:
    from lorafleet_worker.config import ModelConfig

    return ModelConfig.from_dir(worker.model_dir).eos_token_ids[0]


@pytest.mark.parametrize("pin", ["ignore_eos", "min_tokens"])
def test_aiperf_chat_streaming_with_pinned_output_lengths(
    aiperf: Path, worker: Worker, tmp_path: Path, pin: str
) -> None:
    extra: dict[str, Any] = (
        {"ignore_eos": True}
        if pin == "ignore_eos"
        else {"min_tokens": OUTPUT_TOKENS, "logit_bias": {str(_eos(worker)): 100}}
    )
    before = scrape(worker)
    artifacts = tmp_path / "aiperf"
    cmd = [
        str(aiperf),
        "profile",
        "--model", ADAPTER,
        "--url", worker.url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(worker.model_dir),
        "--prompt-input-tokens-mean", "16",
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
        "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", json.dumps(extra),
        "--use-server-token-count",
        "--request-count", str(REQUESTS),
        "--concurrency", "4",
        "--output-artifact-dir", str(artifacts),
        "--ui-type", "none",
        "--no-gpu-telemetry",
        "--workers-max", "1",
        "--record-processor-service-count", "1",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=AIPERF_TIMEOUT_S, cwd=tmp_path)
    assert run.returncode == 0, f"aiperf failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}\n{worker.log_tail()}"

    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and not summary["was_cancelled"]
    assert summary["request_count"]["avg"] == REQUESTS
    osl = summary["output_sequence_length"]
    assert (osl["count"], osl["min"], osl["max"]) == (REQUESTS, OUTPUT_TOKENS, OUTPUT_TOKENS)
    payloads = json.loads((artifacts / "inputs.json").read_text())["data"]
    sent = [p for session in payloads for p in session["payloads"]]
    assert all(p["model"] == ADAPTER and p["stream"] and p["max_completion_tokens"] == OUTPUT_TOKENS for p in sent)

    # the worker agrees: REQUESTS more requests that ran to the length limit, each OUTPUT_TOKENS long
    after = scrape(worker)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == REQUESTS
    assert delta("vllm:generation_tokens_total") == REQUESTS * OUTPUT_TOKENS
