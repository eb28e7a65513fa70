"""Checkpoint loading: dtype names, and a Hugging Face `*.safetensors` model directory into our fused parameters."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lorafleet_worker.config import ModelConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bf16"` / `"bfloat16"` / `torch.bfloat16` -> `torch.bfloat16`; clear error otherwise."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16") from None


# our parameter name (per layer: without `layers.{i}.`) -> the Hugging Face tensors concatenated into it
_LAYER_MAP: dict[str, list[str]] = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "mlp_norm.weight": ["post_attention_layernorm.weight"],
    "qkv_w": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "qkv_b": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "o_w": ["self_attn.o_proj.weight"],
    "o_b": ["self_attn.o_proj.bias"],
    "gate_up_w": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "gate_up_b": ["mlp.gate_proj.bias", "mlp.up_proj.bias"],
    "down_w": ["mlp.down_proj.weight"],
    "down_b": ["mlp.down_proj.bias"],
    "q_norm.weight": ["self_attn.q_norm.weight"],
    "k_norm.weight": ["self_attn.k_norm.weight"],
}
_TOP_MAP: dict[str, str] = {"embed": "embed_tokens.weight", "norm.weight": "norm.weight", "lm_head": "lm_head.weight"}


def _hf_sources(name: str) -> list[str]:
    """Our parameter name -> the Hugging Face tensor names (without `model.`) concatenated into it."""
    if name in _TOP_MAP:
        return [_TOP_MAP[name]]
    _, idx, rest = name.split(".", 2)
    return [f"layers.{idx}.{s}" for s in _LAYER_MAP[rest]]


class Checkpoint:
    """Lazy access to the tensors of every `*.safetensors` file of a model dir, by normalised name."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self._stack = ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}

    def __enter__(self) -> Checkpoint:
        from safetensors import safe_open

        files = self._files()
        for f in files:
            handle = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                self._where[_normalise(key)] = (handle, key)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.dir / n for n in names]
            for f in files:
                if f.parent.resolve() != self.dir.resolve() or not f.is_file():
                    raise ModelConfigError(f"{index}: shard {f.name!r} missing or outside the model directory")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"{self.dir}: no *.safetensors weights found")
        return files

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> Tensor:
        try:
            handle, key = self._where[name]
        except KeyError:
            raise ModelConfigError(f"{self.dir}: tensor {name!r} missing from the checkpoint") from None
        return handle.get_tensor(key)

    def load_into(self, model: nn.Module) -> None:
        """Copy every parameter of `model` from its Hugging Face tensors, checking shapes."""
        for name, param in model.named_parameters():
            value = torch.cat([self.get(s) for s in _hf_sources(name)], dim=0)
            if value.shape != param.shape:
                raise ModelConfigError(
                    f"{self.dir}: {name} has shape {tuple(value.shape)}, config expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)


def init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights in place of a checkpoint (`--load-format dummy`, as vLLM's): matrices uniform in
    [-1e-3, 1e-3] as vLLM draws them, norm weights 1 and biases 0, generated on the parameters' device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.uniform_(-1e-3, 1e-3, generator=gen)
            else:
                param.fill_(1.0 if "norm" in name else 0.0)


def _normalise(key: str) -> str:
    return key.removeprefix("model.")
