"""Dev tools: tiny Hugging Face base models and real PEFT adapters for tests and demos.

`make_tiny_model` writes a random-weight model (transformers' own classes, safetensors,
fp32) with a real byte-level BPE `tokenizer.json`; `make_tiny_adapter` writes a PEFT
LoRA adapter with `peft` itself. Both are deterministic for a given seed.
transformers / peft are imported lazily (they are dev-only dependencies).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

ARCHS = ("llama", "qwen2", "qwen3")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, "<|im_start|>", EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the tiny tokenizer (built in, so the result is deterministic and offline).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a story.
Once upon a time there was a little robot who lived in a quiet village by the sea.
Every morning the robot walked to the harbour, counted the boats, and wrote the number
in a notebook. The fishermen laughed, but the children loved the robot and its stories.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.
Adapters change the behaviour of a base model without retraining all of its weights.
Low-rank adaptation adds two thin matrices to each projection: one down, one up.
Serving thousands of adapters means loading them on demand, caching the popular ones,
and batching requests for different adapters together in the same forward pass.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048. Dates: 2024-01-31, 1999-12-31.
Questions and answers: Where is the library? It is next to the station. When does the
train leave? At seven o'clock in the evening. Why is the sky blue? Because of scattering.
Code: def add(a, b): return a + b. for i in range(10): print(i). x = {"key": "value"}.
The weather was cold and windy, so we stayed inside, drank tea, and read old books.
Mathematics, physics, chemistry, biology, history, geography, music, art and sport.
She said that the meeting would start at noon and that everyone should bring a pen.
"""


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines()
    tok.train_from_iterator(lines * 4, trainer=trainer)
    return tok


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _hf_config(arch: str, **kw: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return classes[arch](**kw)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write a random-weight `arch` model directory (config, safetensors, tokenizer) and return it.

    `vocab_size` is the tokenizer's target size; the model's vocabulary is exactly the
    trained tokenizer's. `initializer_range` is larger than usual so that greedy decoding
    of the random model is not a sea of near-ties.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    _quiet_transformers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab_size)
    vocab = tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    config = _hf_config(
        arch,
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=[eos_id, bos_id])
    model.save_pretrained(out, safe_serialization=True)

    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": BOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


@torch.no_grad()
def _randomize_lora(model: Any, seed: int, strength: float) -> None:
    """Give every LoRA pair deterministic non-zero weights whose delta is `strength` x the base weight's std."""
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    modules: list[tuple[str, Any]] = sorted(model.named_modules(), key=lambda kv: kv[0])
    for _, module in modules:
        if not isinstance(module, LoraLayer):
            continue
        layer = cast(Any, module)  # peft's LoraLayer is untyped
        if "default" not in layer.lora_A:
            continue
        a = layer.lora_A["default"].weight
        b = layer.lora_B["default"].weight
        r, in_dim = a.shape
        base_std = float(layer.get_base_layer().weight.float().std())
        scaling = float(layer.scaling["default"])
        a_std = 1.0 / math.sqrt(in_dim)
        # delta = scaling * B @ A has entries of std scaling * b_std * a_std * sqrt(r)
        b_std = strength * base_std / (scaling * a_std * math.sqrt(r))
        a.copy_(torch.randn(a.shape, generator=gen) * a_std)
        b.copy_(torch.randn(b.shape, generator=gen) * b_std)


def make_tiny_adapter(
    out_dir: str | Path,
    base_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float | None = None,
    rslora: bool = False,
    targets: Sequence[str] = ALL_TARGETS,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    use_dora: bool = False,
    modules_to_save: Sequence[str] | None = None,
    bias: str = "none",
    safetensors: bool = True,
    strength: float = 1.0,
) -> Path:
    """Write a real PEFT LoRA adapter for the model in `base_dir` and return its directory.

    A and B are non-zero (random, seeded); B is scaled so that each module's delta has
    `strength` times the std of its base weight, which visibly changes greedy outputs.
    `alpha` defaults to 2 * rank. `safetensors=False` writes `adapter_model.bin`.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    base = AutoModelForCausalLM.from_pretrained(Path(base_dir), dtype=torch.float32)
    kwargs: dict[str, Any] = dict(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        use_rslora=rslora,
        target_modules=list(targets),
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        lora_dropout=0.0,
        bias=bias,
        use_dora=use_dora,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # transformers' deprecation notices triggered inside peft
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, LoraConfig(**kwargs))
    _randomize_lora(model, seed, strength)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=safetensors)
    return out
