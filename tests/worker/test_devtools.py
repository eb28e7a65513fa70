"""The dev tools (worker/dev, `lorafleet-dev`) write real Hugging Face models and real PEFT adapters."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker_dev.cli import main
from lorafleet_worker_dev.tiny import make_tiny_model
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _greedy(model: object, ids: torch.Tensor, n: int = 12) -> list[int]:
    out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False)  # type: ignore[attr-defined]
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_is_a_loadable_hf_model(tiny_models, arch: str) -> None:
    path = tiny_models[arch]
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (path / name).is_file(), name
    cfg = ModelConfig.from_dir(path)
    assert cfg.model_type == arch
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.attention_bias == (arch == "qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == cfg.vocab_size
    assert tok.eos_token_id in cfg.eos_token_ids
    ids = tok("Hello, world! The robot counted the boats.")["input_ids"]
    assert tok.decode(ids) == "Hello, world! The robot counted the boats."
    assert len(ids) < 20  # real BPE merges, not bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = load_file(str(path / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert model.config.vocab_size == cfg.vocab_size


def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a = load_file(str(make_tiny_model(tmp_path / "a", "qwen3", seed=7) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", "qwen3", seed=7) / "model.safetensors"))
    c = load_file(str(make_tiny_model(tmp_path / "c", "qwen3", seed=8) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_tiny_adapter_is_real_peft_and_changes_outputs(tiny_models, tiny_adapter_factory) -> None:
    base_dir = tiny_models["llama"]
    adapter_dir = tiny_adapter_factory(base_dir, rank=8, alpha=16, seed=1)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["peft_type"] == "LORA"
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    assert all(t.abs().sum() > 0 for t in tensors.values())

    tok = transformers.AutoTokenizer.from_pretrained(base_dir)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base_tokens = _greedy(base, ids)
    lora = peft.PeftModel.from_pretrained(base, str(adapter_dir))
    assert _greedy(lora, ids) != base_tokens


def test_tiny_adapter_variants(tiny_models, tiny_adapter_factory) -> None:
    base_dir = tiny_models["qwen2"]
    bin_dir = tiny_adapter_factory(base_dir, rank=4, targets=("q_proj", "v_proj"), rslora=True, safetensors=False)
    assert (bin_dir / "adapter_model.bin").is_file()
    assert not (bin_dir / "adapter_model.safetensors").exists()
    state = torch.load(bin_dir / "adapter_model.bin", weights_only=True)
    assert {k.rsplit(".", 3)[-3] for k in state} == {"q_proj", "v_proj"}
    cfg = json.loads((bin_dir / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True

    dora = tiny_adapter_factory(base_dir, rank=4, use_dora=True)
    assert json.loads((dora / "adapter_config.json").read_text())["use_dora"] is True
    assert any("lora_magnitude_vector" in k for k in load_file(str(dora / "adapter_model.safetensors")))


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


def test_the_worker_package_ships_no_dev_tools() -> None:
    """The dev tools live in worker/dev (`lorafleet-worker-dev`), which the worker image installs only in its -dev
    variant: nothing of the product package imports them or transformers / peft."""
    import lorafleet_worker

    root = Path(lorafleet_worker.__file__).parent
    assert not (root / "devtools.py").exists() and not (root / "demo.py").exists()
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "lorafleet_worker_dev" not in text, path
        assert not re.search(r"^\s*(import|from) (transformers|peft)\b", text, re.MULTILINE), path
