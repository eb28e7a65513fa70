"""Load and validate a PEFT LoRA adapter directory against a base model's shapes.

Result: per (layer, projection group) and per slice of the group, the module's
A [r, in], B [out_slice, r] (CPU, fp32) and its scaling (alpha/r, or alpha/sqrt(r) for rsLoRA,
with PEFT's `rank_pattern` / `alpha_pattern`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from torch import Tensor

from ..config import ModelConfig
from .errors import AdapterError

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# projection group -> its slices (module names), in output order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# module name -> (group, slice index, parent module in HF's layer)
MODULES: dict[str, tuple[str, int, str]] = {
    name: (group, i, "mlp" if group in ("gate_up", "down") else "self_attn")
    for group, names in GROUPS.items()
    for i, name in enumerate(names)
}
EMBEDDING_MODULES = ("embed_tokens", "lm_head")

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(
    r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+)\.(?P<module>[A-Za-z0-9_]+)"
    r"\.lora_(?P<ab>A|B)(?:\.default)?\.weight$"
)


@dataclass(frozen=True)
class GroupShape:
    in_dim: int
    slice_widths: tuple[int, ...]

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offs = [0]
        for w in self.slice_widths:
            offs.append(offs[-1] + w)
        return tuple(offs)


def group_shapes(config: ModelConfig) -> dict[str, GroupShape]:
    """Input width and per-slice output widths of each projection group of `config`'s layers."""
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": GroupShape(h, (config.q_size, config.kv_size, config.kv_size)),
        "o": GroupShape(config.q_size, (h,)),
        "gate_up": GroupShape(h, (inter, inter)),
        "down": GroupShape(inter, (h,)),
    }


@dataclass(frozen=True)
class LoRAModuleWeights:
    A: Tensor  # [r, in_dim]
    B: Tensor  # [out_slice, r]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])


@dataclass
class LoRAAdapter:
    """A validated adapter: `modules[(layer, group)][slice]` is the slice's weights or None."""

    path: Path
    modules: dict[tuple[int, str], list[LoRAModuleWeights | None]]
    max_rank: int
    content_hash: bytes = b""  # BLAKE3 of its config and weight files (prefix-cache identity)

    @property
    def nbytes(self) -> int:
        return sum(m.A.nbytes + m.B.nbytes for mods in self.modules.values() for m in mods if m is not None)

    @classmethod
    def load(
        cls, path: str | Path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
    ) -> LoRAAdapter:
        """Read and validate the PEFT adapter in `path`; AdapterError says what is wrong."""
        path = Path(path)
        raw = _read_config(path)
        _check_config(raw)
        tensors = _read_weights(path)
        pairs = _collect_pairs(tensors, model_config.num_hidden_layers)
        shapes = group_shapes(model_config)
        modules: dict[tuple[int, str], list[LoRAModuleWeights | None]] = {}
        top = 0
        for (layer, name), (a, b) in sorted(pairs.items()):
            group, idx, parent = MODULES[name]
            shape = shapes[group]
            key = f"model.layers.{layer}.{parent}.{name}"
            r = _check_shapes(key, a, b, shape.in_dim, shape.slice_widths[idx])
            if r > max_rank:
                raise AdapterError(f"rank {r} of {key} exceeds the maximum LoRA rank {max_rank} (--max-lora-rank)")
            slices = modules.setdefault((layer, group), [None] * len(shape.slice_widths))
            slices[idx] = LoRAModuleWeights(A=a.to(dtype), B=b.to(dtype), scaling=_scaling(raw, key, r))
            top = max(top, r)
        return cls(path=path, modules=modules, max_rank=top, content_hash=_content_hash(path))


def _content_hash(path: Path) -> bytes:
    """BLAKE3 over the config and weight files: equal for the same weights, whatever the path or name."""
    h = blake3.blake3()
    for name in (CONFIG_FILE, SAFETENSORS_FILE, BIN_FILE):
        if (path / name).is_file():
            h.update(name.encode())
            h.update_mmap(str(path / name))
    return h.digest()


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"missing {CONFIG_FILE} in {path}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    return raw


def _check_config(raw: dict[str, Any]) -> None:
    """Reject adapter features the engine does not implement."""
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"unsupported peft_type {peft_type!r}: only LORA adapters are supported")
    if raw.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora=true) are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(f"adapters with modules_to_save are not supported (got {raw['modules_to_save']})")
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"LoRA bias={bias!r} is not supported (only bias='none')")
    for unsupported in ("lora_bias", "trainable_token_indices", "target_parameters", "layer_replication"):
        if raw.get(unsupported):
            raise AdapterError(f"adapter option {unsupported} is not supported")
    for field in ("r", "lora_alpha"):
        if not isinstance(raw.get(field, 8), int | float) or raw.get(field, 8) <= 0:
            raise AdapterError(f"{CONFIG_FILE}: {field} must be a positive number")
    targets = raw.get("target_modules")
    if isinstance(targets, list):  # a string is a regex (or "all-linear"): the weight keys decide
        for target in targets:
            _check_module_name(str(target).rsplit(".", 1)[-1])


def _check_module_name(name: str) -> None:
    if name in EMBEDDING_MODULES:
        raise AdapterError(f"LoRA on {name} (embedding / lm_head) is not supported")
    if name not in MODULES:
        raise AdapterError(f"unsupported target module {name!r}; supported: {', '.join(MODULES)}")


def _read_weights(path: Path) -> dict[str, Tensor]:
    st, bin_ = path / SAFETENSORS_FILE, path / BIN_FILE
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st), device="cpu")
        if bin_.is_file():
            state = torch.load(bin_, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
                raise AdapterError(f"{BIN_FILE} does not hold a flat state dict of tensors")
            return state
    except AdapterError:
        raise
    except Exception as e:  # safetensors / pickle raise many types for a damaged file
        name = SAFETENSORS_FILE if st.is_file() else BIN_FILE
        raise AdapterError(f"corrupt or unreadable weight file {name}: {type(e).__name__}: {e}") from e
    raise AdapterError(f"missing adapter weights: neither {SAFETENSORS_FILE} nor {BIN_FILE} in {path}")


def _collect_pairs(tensors: dict[str, Tensor], num_layers: int) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """Group the LoRA tensors by (layer, module) after normalising PEFT's key variants."""
    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    for raw_key, tensor in tensors.items():
        key = raw_key.removeprefix(_PREFIX)
        if "lora_magnitude_vector" in key:
            raise AdapterError("DoRA adapters (lora_magnitude_vector weights) are not supported")
        if "lora_embedding_" in key or any(f"{m}." in key for m in EMBEDDING_MODULES):
            raise AdapterError(f"LoRA on embedding / lm_head is not supported (tensor {raw_key})")
        m = _LORA_KEY.match(key)
        if m is None:
            if key.endswith(".bias"):
                raise AdapterError(f"LoRA bias weights are not supported (tensor {raw_key})")
            raise AdapterError(f"unexpected tensor {raw_key!r} (modules_to_save or a non-LoRA weight?)")
        name, layer = m["module"], int(m["layer"])
        _check_module_name(name)
        if MODULES[name][2] != m["parent"]:
            raise AdapterError(f"unexpected tensor {raw_key!r}: {name} is not under {m['parent']}")
        if layer >= num_layers:
            raise AdapterError(f"tensor {raw_key} is for layer {layer}, but the base model has {num_layers} layers")
        found.setdefault((layer, name), {})[m["ab"]] = tensor
    if not found:
        raise AdapterError("the adapter holds no LoRA weights")
    pairs = {}
    for (layer, name), ab in found.items():
        missing = {"A", "B"} - ab.keys()
        if missing:
            raise AdapterError(f"layer {layer} {name}: lora_{missing.pop()} weight is missing")
        pairs[(layer, name)] = (ab["A"], ab["B"])
    return pairs


def _check_shapes(key: str, a: Tensor, b: Tensor, in_dim: int, out_dim: int) -> int:
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(f"{key}: lora_A and lora_B must be 2-D (got {tuple(a.shape)} and {tuple(b.shape)})")
    r = int(a.shape[0])
    if tuple(a.shape) != (r, in_dim) or tuple(b.shape) != (out_dim, r) or r == 0:
        raise AdapterError(
            f"shape mismatch with the base model at {key}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
            f"expected lora_A (r, {in_dim}) and lora_B ({out_dim}, r)"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{key}: LoRA weights contain NaN or Inf")
    return r


def _pattern_value(patterns: Any, key: str, default: float) -> float:
    """PEFT's `get_pattern_key`: the first pattern p with `(.*\\.)?(p)$` matching the module key."""
    if not isinstance(patterns, dict):
        return default
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return float(value)
        except re.error as e:
            raise AdapterError(f"invalid rank/alpha pattern {pattern!r}: {e}") from e
    return default


def _scaling(raw: dict[str, Any], key: str, rank: int) -> float:
    """Scaling of the module `key` with actual rank `rank` (checked against r / rank_pattern)."""
    r = _pattern_value(raw.get("rank_pattern"), key, float(raw.get("r", 8)))
    if int(r) != rank:
        raise AdapterError(f"{key}: weights have rank {rank} but {CONFIG_FILE} says r={int(r)}")
    alpha = _pattern_value(raw.get("alpha_pattern"), key, float(raw.get("lora_alpha", 8)))
    return alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
