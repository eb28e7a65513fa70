"""A served model's shape without its weights, for `bench/bench_gpu.py`'s end-to-end roofline.

`shape_model_dir` writes a model directory holding only a config of the shape (Llama-3-8B by default) and a
tokenizer: the worker builds its weights on the device (`--load-format dummy`), so nothing is downloaded or
written but the config. `write_peft_adapter` writes a real PEFT LoRA adapter (adapter_config.json +
adapter_model.safetensors) of that shape without building the base model. `decode_step_bytes` and
`prefill_flops` are the roofline's arithmetic: what one decode step must read and what a prefill must
compute.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def proj_dims(self) -> dict[str, tuple[int, int]]:
        """Projection -> (in, out) features."""
        h, q, kv, inter = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }

    def linear_params(self) -> int:
        """Parameters of the decoder layers' linears (all layers)."""
        return self.num_layers * sum(i * o for i, o in self.proj_dims().values())

    def kv_bytes_per_token(self, elem: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem


LLAMA3_8B = Shape("llama3-8b", 4096, 32, 32, 8, 14336, 128256)
DRY_SHAPE = Shape("dry-run", 64, 2, 4, 2, 128, 512, rope_theta=10000.0, max_position_embeddings=2048)


def shape_model_dir(shape: Shape, out: Path, tokenizer_dir: Path, dtype: str = "bfloat16") -> Path:
    """`out` with the config of `shape` and the tokenizer files of `tokenizer_dir` (no weights)."""
    src = json.loads((tokenizer_dir / "config.json").read_text())
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_peft_adapter(
    out: Path,
    shape: Shape,
    rank: int,
    *,
    seed: int,
    device: Any = "cpu",
    targets: Sequence[str] = ALL_TARGETS,
) -> Path:
    """A PEFT LoRA adapter of `rank` on `targets` of every layer, bf16, random (A ~ 1/sqrt(in), B ~ 1/sqrt(r)),
    generated on `device` and written to `out` (cached: an existing adapter is kept)."""
    import torch
    from safetensors.torch import save_file

    if (out / "adapter_config.json").is_file():
        return out
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = shape.proj_dims()
    tensors = {}
    for layer in range(shape.num_layers):
        for t in targets:
            fan_in, fan_out = dims[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            a = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen, device=device) / rank**0.5 * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu().contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu().contiguous()
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": shape.name,
    }
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def adapter_bytes(shape: Shape, rank: int, elem: int, targets: Sequence[str] = ALL_TARGETS) -> int:
    """Bytes of one adapter's A and B matrices (what a step reads once per distinct adapter in the batch)."""
    dims = shape.proj_dims()
    return shape.num_layers * rank * sum(dims[t][0] + dims[t][1] for t in targets) * elem


def decode_step_bytes(
    shape: Shape, *, num_seqs: int, context: float, elem: int, adapter_ranks: Sequence[int] = ()
) -> dict[str, int]:
    """The least one decode step of `num_seqs` sequences at mean `context` tokens must read: every weight
    (the decoder's linears and the lm_head; one embedding row per sequence, negligible), each sequence's
    KV, and the A/B matrices of each distinct adapter in the batch."""
    weights = (shape.linear_params() + shape.vocab_size * shape.hidden_size) * elem
    kv = int(num_seqs * context * shape.kv_bytes_per_token(elem))
    lora = sum(adapter_bytes(shape, r, elem) for r in adapter_ranks)
    return {"weights": weights, "kv": kv, "lora": lora, "total": weights + kv + lora}


def prefill_flops(shape: Shape, *, num_seqs: int, prompt_len: int) -> int:
    """Matmul FLOPs of prefilling `num_seqs` prompts of `prompt_len` tokens: the linears for every token,
    causal attention (QK^T and PV over half the square), the lm_head for each sequence's last token."""
    tokens = num_seqs * prompt_len
    linears = 2 * shape.linear_params() * tokens
    attention = num_seqs * shape.num_layers * 2 * shape.num_heads * shape.head_dim * prompt_len * prompt_len
    head = 2 * shape.vocab_size * shape.hidden_size * num_seqs
    return linears + attention + head
