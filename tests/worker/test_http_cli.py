"""`lorafleet-worker` CLI: dev-tool subcommands write real files; `serve` fails clearly on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lorafleet_worker.cli import _admin_token, main


def test_make_tiny_adapter_writes_a_peft_adapter(tiny_models: Any, tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    assert main(["make-tiny-adapter", str(out), "--base", str(tiny_models["llama"]), "--rank", "4", "--alpha", "3",
                 "--rslora", "--targets", "q_proj", "v_proj", "--seed", "5"]) == 0  # fmt: skip
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 3 and config["use_rslora"] is True
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert (out / "adapter_model.safetensors").stat().st_size > 0


def test_make_tiny_model_writes_a_model(tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert main(["make-tiny-model", str(out), "--arch", "qwen3", "--seed", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert (out / "tokenizer.json").is_file()


def test_serve_rejects_a_directory_without_a_model(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "lorafleet_worker", "serve", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "not a Hugging Face model directory" in r.stderr


def test_admin_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAFLEET_ADMIN_TOKEN_FILE", raising=False)
    monkeypatch.delenv("LORAFLEET_ADMIN_TOKEN", raising=False)
    assert _admin_token(None) is None
    monkeypatch.setenv("LORAFLEET_ADMIN_TOKEN", " from-env ")
    assert _admin_token(None) == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert _admin_token(token_file) == "from-file"
    monkeypatch.setenv("LORAFLEET_ADMIN_TOKEN_FILE", str(token_file))
    assert _admin_token(None) == "from-file"
    token_file.write_text("  \n")
    with pytest.raises(SystemExit, match="empty"):
        _admin_token(token_file)
