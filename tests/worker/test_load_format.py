"""`--load-format dummy`: a model directory with only its config and tokenizer serves, with random weights."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.model import Transformer
from lorafleet_worker.sample.params import SamplingParams


def config_only(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` without its weights."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dummy_weights_have_the_config_shapes(tiny_models: Any, tmp_path: Path, arch: str) -> None:
    bare = config_only(tiny_models[arch], tmp_path / "bare")
    real = Transformer.from_pretrained(tiny_models[arch])
    dummy = Transformer.from_pretrained(bare, load_format="dummy")
    shapes = {n: p.shape for n, p in real.named_parameters()}
    assert {n: p.shape for n, p in dummy.named_parameters()} == shapes
    for name, p in dummy.named_parameters():
        if p.dim() >= 2:
            assert 0 < p.abs().max().item() <= 1e-3, name
            assert p.std().item() > 1e-4, name  # random, not constant
        elif "norm" in name:
            assert torch.all(p == 1), name
    again = Transformer.from_pretrained(bare, load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(dummy.parameters(), again.parameters(), strict=True))


def test_auto_still_needs_the_weights(tiny_models: Any, tmp_path: Path) -> None:
    bare = config_only(tiny_models["llama"], tmp_path / "bare")
    with pytest.raises(Exception, match=r"no \*\.safetensors"):
        Transformer.from_pretrained(bare)
    with pytest.raises(ValueError, match="unknown load_format"):
        Transformer.from_pretrained(bare, load_format="npz")


async def test_engine_serves_a_dummy_model(tiny_models: Any, tmp_path: Path) -> None:
    bare = config_only(tiny_models["llama"], tmp_path / "bare")
    engine = Engine(bare, load_format="dummy", max_loras=0, max_model_len=256)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        out = [t async for t in engine.generate("r1", [3, 4, 5, 6], params)]
        assert len(out) == 5
    finally:
        await engine.stop()
