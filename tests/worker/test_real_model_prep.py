"""`make setup`'s real-model steps from an empty cache, as on a fresh machine.

CI's machine keeps `$LORAFLEET_CACHE` between runs, so a cached model or adapter set would hide a broken
preparation step (a fresh machine once failed at the model's check while CI stayed green). Here both
steps run into a temporary `LORAFLEET_CACHE`, reusing only the package downloads (uv's cache): the
model's conversion and its check (with the worker's weight packing on, and again with it off), a check
that fails on a wrongly loaded weight, and the adapter trainer on one step per adapter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from demo import real_model
from demo.real_model import READY, ModelPrepError, check_logits, content_digest
from demo.train_adapters import RECIPES, adapters_dir, trained_adapters

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def empty_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh LORAFLEET_CACHE (uv's package cache shared with the real one, downloads only)."""
    cache = tmp_path_factory.mktemp("fresh-cache")
    saved = {k: os.environ.get(k) for k in ("LORAFLEET_CACHE", "UV_CACHE_DIR")}
    os.environ["UV_CACHE_DIR"] = saved["UV_CACHE_DIR"] or str(real_model.cache_root() / "uv")
    os.environ["LORAFLEET_CACHE"] = str(cache)
    yield cache
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def fresh_model(empty_cache: Path) -> Path:
    """`make model` (python -m demo.real_model) into the empty cache: install, convert, check."""
    proc = subprocess.run(
        [sys.executable, "-m", "demo.real_model"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path == empty_cache / "models" / real_model.MODEL_KEY
    assert "the worker's log-probs match transformers'" in proc.stderr
    return path


def test_preparation_from_an_empty_cache(fresh_model: Path) -> None:
    ready = json.loads((fresh_model / READY).read_text())
    assert ready["code"] == real_model.CODE_DIGEST and ready["code"] in real_model.MODEL_KEY
    assert ready["content"] == content_digest(fresh_model)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in fresh_model.iterdir()}


def test_check_passes_without_weight_packing(fresh_model: Path) -> None:
    """The check holds for the plain torch layout too (the prepacked one ran in the fixture)."""
    code = f"import pathlib, demo.real_model as m; print(m.check_logits(pathlib.Path({str(fresh_model)!r})))"
    env = {**os.environ, "LORAFLEET_CPU_LINEAR": "torch"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) <= real_model.CHECK_ATOL


def test_check_fails_on_a_wrongly_loaded_weight(fresh_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reads one projection transposed (a square matrix: it still loads, and the old parameter
    count could not see it) fails the check, while transformers reads the directory correctly."""
    from lorafleet_worker.model.loading import Checkpoint

    read = Checkpoint.get

    def transposed_q_proj(self: Checkpoint, name: str) -> torch.Tensor:
        tensor = read(self, name)
        return tensor.t().contiguous() if name.endswith("layers.3.self_attn.q_proj.weight") else tensor

    monkeypatch.setattr(Checkpoint, "get", transposed_q_proj)
    with pytest.raises(ModelPrepError, match="differ from transformers'"):
        check_logits(fresh_model)


def test_adapter_training_from_an_empty_cache(fresh_model: Path, empty_cache: Path) -> None:
    """demo.train_adapters' cached training, one step per adapter, keyed by the model's content."""
    quick = {style: replace(recipe, steps=1, batch=1) for style, recipe in RECIPES.items()}
    adapters = trained_adapters(quick)
    root = adapters_dir(quick)
    assert root.parent == empty_cache / "adapters"
    assert content_digest(fresh_model)[:12] in root.name and root != adapters_dir()
    for style, path in adapters.items():
        assert path == root / style and (path / READY).is_file(), style
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == RECIPES[style].rank and set(config["target_modules"]) == set(RECIPES[style].targets)
        tensors = load_file(path / "adapter_model.safetensors")
        assert any("lora_B" in k and torch.count_nonzero(t) for k, t in tensors.items()), style
    assert trained_adapters(quick) == adapters  # cached: the second call trains nothing
