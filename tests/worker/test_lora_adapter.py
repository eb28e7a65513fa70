"""PEFT adapter loading: weights and scalings equal PEFT's own, key variants, every validation error."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.lora.adapter import GROUPS, LoRAAdapter
from lorafleet_worker.lora.errors import AdapterError
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MAX_RANK = 64


def _deltas(adapter: LoRAAdapter) -> dict[str, torch.Tensor]:
    """module key -> scaling * B @ A."""
    out = {}
    for (layer, group), slices in adapter.modules.items():
        for name, m in zip(GROUPS[group], slices, strict=True):
            if m is not None:
                parent = "mlp" if group in ("gate_up", "down") else "self_attn"
                out[f"model.layers.{layer}.{parent}.{name}"] = m.scaling * (m.B @ m.A)
    return out


def _peft_deltas(base_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    from peft.tuners.lora import LoraLayer

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir))
    out = {}
    for name, module in model.base_model.model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            out[name] = cast(Any, module).get_delta_weight("default").detach()
    return out


CASES: dict[str, dict[str, Any]] = {
    "plain": {"rank": 8, "alpha": 16},
    "rslora": {"rank": 16, "alpha": 8, "rslora": True, "seed": 1},
    "patterns": {
        "rank": 8,
        "alpha": 16,
        "rank_pattern": {"q_proj": 4, "model.layers.1.mlp.down_proj": 32, r"layers\.0\..*up_proj": 12},
        "alpha_pattern": {"v_proj": 3, "o_proj": 40},
        "seed": 2,
    },
    "subset_targets": {"rank": 64, "alpha": 32, "targets": ("k_proj", "up_proj"), "seed": 3},
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_delta_equals_peft(tiny_models, tiny_adapter_factory, arch: str, case: str) -> None:
    base_dir = tiny_models[arch]
    adapter_dir = tiny_adapter_factory(base_dir, **CASES[case])
    adapter = LoRAAdapter.load(adapter_dir, ModelConfig.from_dir(base_dir), MAX_RANK)
    ours, theirs = _deltas(adapter), _peft_deltas(base_dir, adapter_dir)
    assert ours.keys() == theirs.keys()
    for key, delta in theirs.items():
        torch.testing.assert_close(ours[key], delta, rtol=1e-5, atol=1e-6, msg=key)
    if case == "patterns":
        ranks = {(layer, g): [m.rank if m else 0 for m in ms] for (layer, g), ms in adapter.modules.items()}
        assert ranks[(0, "qkv")] == [4, 8, 8]
        assert ranks[(0, "gate_up")] == [8, 12]
        assert ranks[(1, "gate_up")] == [8, 8]
        assert ranks[(1, "down")] == [32]
        assert adapter.max_rank == 32
        v = adapter.modules[(0, "qkv")][2]
        assert v is not None and v.scaling == pytest.approx(3 / 8)
    if case == "rslora":
        q = adapter.modules[(0, "qkv")][0]
        assert q is not None and q.scaling == pytest.approx(8 / 16**0.5)
    if case == "subset_targets":
        assert (0, "o") not in adapter.modules
        assert [m is not None for m in adapter.modules[(1, "qkv")]] == [False, True, False]


@pytest.fixture(scope="module")
def llama(tiny_models) -> tuple[Path, ModelConfig]:
    return tiny_models["llama"], ModelConfig.from_dir(tiny_models["llama"])


@pytest.fixture(scope="module")
def reference(llama, tiny_adapter_factory) -> tuple[Path, LoRAAdapter]:
    adapter_dir = tiny_adapter_factory(llama[0], rank=8, alpha=16, seed=5)
    return adapter_dir, LoRAAdapter.load(adapter_dir, llama[1], MAX_RANK)


def _same(a: LoRAAdapter, b: LoRAAdapter) -> None:
    da, db = _deltas(a), _deltas(b)
    assert da.keys() == db.keys()
    for key in da:
        torch.testing.assert_close(da[key], db[key], rtol=0, atol=0)


def _rewrite_keys(src: Path, dst: Path, rename: Callable[[str], str]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    return dst


def test_bin_weights(llama, reference, tiny_adapter_factory) -> None:
    bin_dir = tiny_adapter_factory(llama[0], rank=8, alpha=16, seed=5, safetensors=False)
    assert not (bin_dir / "adapter_model.safetensors").exists()
    _same(LoRAAdapter.load(bin_dir, llama[1], MAX_RANK), reference[1])


@pytest.mark.parametrize(
    "rename",
    [
        lambda k: k.removeprefix("base_model.model."),
        lambda k: k.replace(".weight", ".default.weight"),
        lambda k: k.removeprefix("base_model.model.model."),
    ],
    ids=["no_prefix", "default_suffix", "bare_layers"],
)
def test_key_variants(llama, reference, tmp_path: Path, rename: Callable[[str], str]) -> None:
    variant = _rewrite_keys(reference[0], tmp_path / "variant", rename)
    _same(LoRAAdapter.load(variant, llama[1], MAX_RANK), reference[1])


def test_weights_are_cast_to_requested_dtype(llama, reference) -> None:
    adapter = LoRAAdapter.load(reference[0], llama[1], MAX_RANK, dtype=torch.bfloat16)
    m = adapter.modules[(0, "qkv")][0]
    assert m is not None and m.A.dtype == torch.bfloat16 and m.A.device.type == "cpu"
    assert adapter.nbytes == reference[1].nbytes // 2


# ----- validation: each case builds a broken adapter and names the message it must produce -----


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(d / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "adapter_model.safetensors"))


def _truncate(d: Path) -> None:
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _garbage_bin(d: Path) -> None:
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"not a pickle at all")


def _drop_b(tensors: dict[str, torch.Tensor]) -> None:
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]


def _unknown_module(tensors: dict[str, torch.Tensor]) -> None:
    for ab in "AB":
        key = f"base_model.model.model.layers.0.mlp.up_proj.lora_{ab}.weight"
        tensors[key.replace("up_proj", "fc_proj")] = tensors.pop(key)


def _extra_bias(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)


def _unknown_module_adapter(d: Path) -> None:
    _edit_config(d, target_modules=".*proj")
    _edit_tensors(d, _unknown_module)


BROKEN: dict[str, tuple[Callable[[Path], object], str]] = {
    "no_config": (lambda d: (d / "adapter_config.json").unlink(), "missing adapter_config.json"),
    "bad_json": (lambda d: (d / "adapter_config.json").write_text("{nope"), "not valid JSON"),
    "no_weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "missing adapter weights"),
    "truncated_safetensors": (_truncate, "corrupt or unreadable weight file adapter_model.safetensors"),
    "garbage_bin": (_garbage_bin, "corrupt or unreadable weight file adapter_model.bin"),
    "dora_flag": (lambda d: _edit_config(d, use_dora=True), "DoRA"),
    "modules_to_save_flag": (lambda d: _edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias_flag": (lambda d: _edit_config(d, bias="lora_only"), "bias='lora_only'"),
    "bias_tensor": (lambda d: _edit_tensors(d, _extra_bias), "bias"),
    "unsupported_target": (
        lambda d: _edit_config(d, target_modules=["q_proj", "fc_proj"]),
        "unsupported target module 'fc_proj'",
    ),
    "unsupported_module_key": (
        _unknown_module_adapter,
        "unsupported target module 'fc_proj'",
    ),
    "missing_b": (lambda d: _edit_tensors(d, _drop_b), "layer 1 up_proj: lora_B weight is missing"),
    "rank_disagrees_with_config": (lambda d: _edit_config(d, r=4), "weights have rank 8 but adapter_config.json"),
    "not_lora": (lambda d: _edit_config(d, peft_type="IA3"), "only LORA adapters"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_invalid_adapter_is_rejected(llama, reference, tmp_path: Path, case: str) -> None:
    break_it, message = BROKEN[case]
    broken = shutil.copytree(reference[0], tmp_path / "broken")
    break_it(broken)
    with pytest.raises(AdapterError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        LoRAAdapter.load(broken, llama[1], MAX_RANK)
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"targets": ("q_proj", "embed_tokens")}, "embed_tokens"),
        ({"targets": ("q_proj", "lm_head")}, "lm_head"),
        ({"bias": "all"}, "bias"),
    ],
    ids=["dora", "modules_to_save", "embedding", "lm_head", "bias"],
)
def test_unsupported_peft_features(llama, tiny_adapter_factory, kwargs: dict, message: str) -> None:
    adapter_dir = tiny_adapter_factory(llama[0], rank=4, **kwargs)
    with pytest.raises(AdapterError, match=message):
        LoRAAdapter.load(adapter_dir, llama[1], MAX_RANK)


def test_embedding_tensors_rejected_even_if_config_is_silent(llama, tiny_adapter_factory, tmp_path: Path) -> None:
    src = tiny_adapter_factory(llama[0], rank=4, targets=("q_proj", "embed_tokens"))
    broken = shutil.copytree(src, tmp_path / "broken")
    _edit_config(broken, target_modules=".*")
    with pytest.raises(AdapterError, match="embedding"):
        LoRAAdapter.load(broken, llama[1], MAX_RANK)


def test_rank_above_max(llama, tiny_adapter_factory) -> None:
    adapter_dir = tiny_adapter_factory(llama[0], rank=16, rank_pattern={"down_proj": 32})
    assert LoRAAdapter.load(adapter_dir, llama[1], 32).max_rank == 32
    with pytest.raises(AdapterError, match=r"rank 32 of model\.layers\.0\.mlp\.down_proj exceeds .* 16"):
        LoRAAdapter.load(adapter_dir, llama[1], 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"intermediate_size": 96}, r"shape mismatch with the base model at model\.layers\.0\.mlp\.down_proj"),
        ({"num_key_value_heads": 4}, r"shape mismatch with the base model at model\.layers\.0\.self_attn\.k_proj"),
        ({"hidden_size": 32}, "shape mismatch with the base model"),
        ({"num_hidden_layers": 1}, "is for layer 1, but the base model has 1 layers"),
    ],
)
def test_mismatch_with_base_model(llama, reference, change: dict, message: str) -> None:
    other = dataclasses.replace(llama[1], **change)
    with pytest.raises(AdapterError, match=message):
        LoRAAdapter.load(reference[0], other, MAX_RANK)


def test_missing_directory(llama, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        LoRAAdapter.load(tmp_path / "nowhere", llama[1], MAX_RANK)
