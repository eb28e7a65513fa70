"""End to end through a real worker: one adapter loaded from file://, s3:// (MinIO, via the sync job)
and hf:// (local hub) gives identical outputs; source errors come back as clear HTTP errors."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.minio import MinioServer

from tests.worker.conftest import Worker, start_worker, stop_worker

from .conftest import HF_TOKEN, Run


@pytest.fixture(scope="module")
def source_worker(
    tiny_models: Any, minio: MinioServer, hub: LocalHub, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """A worker whose environment points at the test MinIO and hub."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**minio.env(), "HF_ENDPOINT": hub.url, "HF_TOKEN": HF_TOKEN}.items():
            mp.setenv(key, value)
        worker = start_worker(tiny_models["llama"], tmp_path_factory.mktemp("source_worker"), name="tiny-llama")
    yield worker
    stop_worker(worker)


def _load_error(worker: Worker, name: str, uri: str) -> httpx.Response:
    return httpx.post(f"{worker.system_url}/v1/loras", json={"lora_name": name, "source": {"uri": uri}}, timeout=120)


def test_same_adapter_from_three_sources_gives_identical_outputs(
    source_worker: Worker,
    tiny_adapter_factory: Callable[..., Path],
    run_sync: Callable[..., Run],
    hub: LocalHub,
    minio: MinioServer,
) -> None:
    adapter = tiny_adapter_factory(source_worker.model_dir, rank=8, seed=41)
    local = source_worker.file_root / "e2e-adapter"
    shutil.copytree(adapter, local, dirs_exist_ok=True)
    sha = hub.commit("acme/e2e-adapter", adapter)
    bucket = minio.make_bucket()
    synced = run_sync("--source", "hf://acme/e2e-adapter@main", "--dest", f"s3://{bucket}/mirror")
    assert synced.code == 0, synced.stderr
    assert synced.last_line == f"s3://{bucket}/mirror/acme/e2e-adapter/{sha}"

    source_worker.load("from-file", f"file://{local}")
    source_worker.load("from-s3", synced.last_line)
    source_worker.load("from-hf", "hf://acme/e2e-adapter@main")

    prompt = [1, 5, 9, 13, 17, 21]
    outputs = {
        name: source_worker.complete(name, prompt, max_tokens=8, logprobs=1)["choices"][0]
        for name in ("from-file", "from-s3", "from-hf", "tiny-llama")
    }
    texts = {name: out["text"] for name, out in outputs.items()}
    logprobs = {name: out["logprobs"]["token_logprobs"] for name, out in outputs.items()}
    assert texts["from-file"] == texts["from-s3"] == texts["from-hf"]
    assert logprobs["from-file"] == logprobs["from-s3"] == logprobs["from-hf"]
    assert (texts["from-file"], logprobs["from-file"]) != (texts["tiny-llama"], logprobs["tiny-llama"])


@pytest.mark.parametrize(
    ("uri", "status", "needle"),
    [
        ("s3://no-such-bucket-e2e/x", 400, "s3://no-such-bucket-e2e/x"),
        ("hf://acme/no-such-repo", 400, "hf://acme/no-such-repo"),
        ("file:///etc", 400, "outside the allowed roots"),
        ("s3://bucket/../x", 400, ".."),
    ],
)
def test_source_errors_are_clear_http_errors(source_worker: Worker, uri: str, status: int, needle: str) -> None:
    response = _load_error(source_worker, "bad-source", uri)
    assert response.status_code == status, response.text
    assert needle in response.json()["message"]
    assert source_worker.is_alive() and "bad-source" not in source_worker.loras()
