"""Fixtures for adapter-source and sync-job tests: a real MinIO, a local Hugging Face hub, adapters."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.minio import MinioServer
from lorafleet_sync.hf import HfSettings
from lorafleet_sync.retry import FetchPolicy
from lorafleet_sync.s3 import S3Settings
from lorafleet_sync.sources import AdapterSources

HF_TOKEN = "hf_" + secrets.token_hex(12)
SYNC = Path(sys.executable).parent / "lorafleet-sync"


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        return self.stdout.strip().splitlines()[-1] if self.stdout.strip() else ""


@pytest.fixture
def run_sync(minio: MinioServer, hub: LocalHub) -> Callable[..., Run]:
    def run(*args: str, token: str = HF_TOKEN, endpoint: str | None = None) -> Run:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "HUGGING"))}
        env.update(minio.env())
        env.update({"HF_ENDPOINT": endpoint or hub.url, "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1"})
        proc = subprocess.run([str(SYNC), "-v", *args], env=env, capture_output=True, text=True, timeout=120)
        output = proc.stdout + proc.stderr
        assert token not in output and minio.secret_key not in output and minio.access_key not in output, output
        return Run(proc.returncode, proc.stdout, proc.stderr)

    return run


def write_adapter(
    directory: Path, seed: int = 0, weight_bytes: int = 4096, extra: dict[str, bytes] | None = None
) -> Path:
    """Plain adapter-shaped files (config + opaque weights) for source-level tests."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "seed": seed}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    (directory / "adapter_model.safetensors").write_bytes(os.urandom(weight_bytes))
    for rel, data in (extra or {}).items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    return directory


def read_tree(directory: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file (manifest excluded) — to compare fetched copies."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "lorafleet-manifest.json"
    }


def s3_settings_for(minio: MinioServer) -> S3Settings:
    return S3Settings(minio.url, "us-east-1", True, minio.access_key, minio.secret_key)


@pytest.fixture(scope="session")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    server = MinioServer(tmp_path_factory.mktemp("minio") / "data").start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHub]:
    with LocalHub(tmp_path_factory.mktemp("hub"), token=HF_TOKEN) as server:
        yield server


@pytest.fixture
def bucket(minio: MinioServer) -> str:
    return minio.make_bucket()


def _sources_factory(tmp_path: Path, base: dict[str, Any]) -> Callable[..., AdapterSources]:
    counter = iter(range(1000))
    (tmp_path / "roots").mkdir(exist_ok=True)

    def factory(**kwargs: Any) -> AdapterSources:
        options: dict[str, Any] = {
            "cache_dir": tmp_path / f"cache{next(counter)}",
            "file_roots": [tmp_path / "roots"],
            "policy": FetchPolicy(deadline_s=20, initial_backoff_s=0.05, max_backoff_s=0.5),
            **base,
            **kwargs,
        }
        return AdapterSources(**options)

    return factory


@pytest.fixture
def make_sources(tmp_path: Path) -> Callable[..., AdapterSources]:
    """AdapterSources with a fresh cache dir and ``tmp_path/roots`` as file root; kwargs override."""
    return _sources_factory(tmp_path, {})


@pytest.fixture
def remote_sources(tmp_path: Path, minio: MinioServer, hub: LocalHub) -> Callable[..., AdapterSources]:
    """Like ``make_sources``, wired to the test MinIO and hub."""
    return _sources_factory(
        tmp_path, {"s3_settings": s3_settings_for(minio), "hf_settings": HfSettings(hub.url, HF_TOKEN)}
    )
