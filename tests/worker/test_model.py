"""Own model code against Hugging Face transformers on the same weights (fp32)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.config import ModelConfig, ModelConfigError
from lorafleet_worker.core.batch_builder import build_forward_batch
from lorafleet_worker.core.kv_cache import PagedKVCache
from lorafleet_worker.core.kv_cache_manager import KVCacheManager
from lorafleet_worker.core.request import Sequence
from lorafleet_worker.core.step import ScheduledChunk, StepPlan
from lorafleet_worker.model import Transformer
from lorafleet_worker.ops import cpu_attention
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker_dev.tiny import make_tiny_model
from safetensors.torch import load_file, save_file

CPU = torch.device("cpu")
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 311, 64, 12, 1, 77, 140, 33, 21, 9]
CHUNKS = [7, 6, 1, 1, 1, 1]  # prefill, prefill with prior context, then decode steps


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def our_logprobs(model: Transformer, ids: list[int], chunks: list[int] = CHUNKS, block_size: int = 4) -> torch.Tensor:
    """Run `ids` through the paged forward pass chunk by chunk; log-probs of every position."""
    assert sum(chunks) == len(ids)
    kv = PagedKVCache(model.config, num_blocks=16, block_size=block_size, device=model.device, dtype=model.dtype)
    blocks = KVCacheManager(16, block_size)
    seq = Sequence.create("r", ids, SamplingParams(), max_len=len(ids) + 1)
    rows = []
    for n in chunks:
        assert blocks.allocate(seq, seq.num_computed + n)
        kv.zero(blocks.take_new_blocks())
        chunk = ScheduledChunk(seq, n, blocks.block_ids(seq))
        batch, _ = build_forward_batch(StepPlan([chunk], int(n == 1)), block_size, model.device)
        batch.logits_indices = torch.arange(n)
        rows.append(model(batch, kv))
        seq.num_computed += n
    return torch.log_softmax(torch.cat(rows), -1)


def decode_backend(name: str) -> str:
    """A CPU decode-attention backend for the parity tests; the native one where it builds here."""
    if name == "cpu" and not cpu_attention.available():
        pytest.skip("the C++ CPU decode attention does not build on this machine")
    return name


@pytest.mark.parametrize("attn", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logprobs_match_transformers(tiny_models: Any, arch: str, attn: str) -> None:
    model = Transformer.from_pretrained(tiny_models[arch], attn_backend=decode_backend(attn))
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    ids = PROMPT
    ref = hf_logprobs(tiny_models[arch], ids)
    ours = our_logprobs(model, ids)
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_qwen2_loads_qkv_bias(tiny_models: Any) -> None:
    model = Transformer.from_pretrained(tiny_models["qwen2"])
    layer = model.layers[0]
    assert layer.qkv_b is not None and layer.o_b is None and layer.q_norm is None
    assert Transformer.from_pretrained(tiny_models["qwen3"]).layers[0].q_norm is not None


def test_sharded_checkpoint_and_names_without_model_prefix(tiny_models: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_models["llama"]
    ref = our_logprobs(Transformer.from_pretrained(src), PROMPT)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").exists()
    assert torch.equal(our_logprobs(Transformer.from_pretrained(sharded), PROMPT), ref)

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(src / "config.json", bare / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, str(bare / "model.safetensors"))
    assert torch.equal(our_logprobs(Transformer.from_pretrained(bare), PROMPT), ref)


def test_tied_embeddings(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "tied", "qwen2", tie_word_embeddings=True, num_layers=1)
    model = Transformer.from_pretrained(d)
    assert model.lm_head is None
    assert (our_logprobs(model, PROMPT) - hf_logprobs(d, PROMPT)).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ],
)  # fmt: skip
def test_rope_scaling_matches_transformers(tiny_models: Any, tmp_path: Path, rope_scaling: dict[str, Any]) -> None:
    d = tmp_path / "scaled"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = rope_scaling
    (d / "config.json").write_text(json.dumps(cfg))
    ours = our_logprobs(Transformer.from_pretrained(d), PROMPT)
    assert (ours - hf_logprobs(d, PROMPT)).abs().max().item() < 1e-4
    unscaled = our_logprobs(Transformer.from_pretrained(tiny_models["llama"]), PROMPT)
    assert (ours - unscaled).abs().max().item() > 1e-3  # the scaling really changed the model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(tiny_models: Any, dtype: torch.dtype) -> None:
    d = tiny_models["llama"]
    half = Transformer.from_pretrained(d, dtype=dtype)
    assert half.embed.dtype == dtype and half.layers[0].qkv_w.dtype == dtype
    assert half.inv_freq.dtype == torch.float32
    ref = our_logprobs(Transformer.from_pretrained(d), PROMPT)
    got = our_logprobs(half, PROMPT)
    assert got.dtype == torch.float32
    assert (got.exp() - ref.exp()).abs().max().item() < 0.05


def test_bad_checkpoints_give_clear_errors(tiny_models: Any, tmp_path: Path) -> None:
    src = tiny_models["llama"]
    d = tmp_path / "broken"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    with pytest.raises(ModelConfigError, match=r"no \*\.safetensors"):
        Transformer.from_pretrained(d)
    tensors = load_file(str(src / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, str(d / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        Transformer.from_pretrained(d)
    wrong = dict(tensors)
    wrong["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(wrong, str(d / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="shape"):
        Transformer.from_pretrained(d)


@pytest.mark.parametrize("attn", ["torch", "cpu"])
def test_mistral_sliding_window_matches_transformers(tmp_path: Path, attn: str) -> None:
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "mistral")
    model = Transformer.from_pretrained(tmp_path / "mistral", attn_backend=decode_backend(attn))
    assert model.config.sliding_window == 5 and model.attn_backend == attn
    ours = our_logprobs(model, PROMPT)
    assert (ours - hf_logprobs(tmp_path / "mistral", PROMPT)).abs().max().item() < 1e-4
    full = Transformer(dataclasses.replace(model.config, sliding_window=None), attn_backend=attn)
    full.load_state_dict(model.state_dict())
    assert (our_logprobs(full, PROMPT) - ours).abs().max().item() > 1e-3  # the window really mattered


def test_eos_ids_merge_generation_config(tiny_models: Any, tmp_path: Path) -> None:
    d = shutil.copytree(tiny_models["llama"], tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "eos_token_id": 5}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 9]}))
    assert ModelConfig.from_dir(d).eos_token_ids == (5, 7, 9)
    (d / "generation_config.json").write_text("{not json")
    assert ModelConfig.from_dir(d).eos_token_ids == (5,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_are_the_cos_sin_of_each_position(tiny_models: Any, dtype: torch.dtype) -> None:
    """The CPU cos / sin tables (grown past their first 256 positions) give the values `rope_cos_sin`
    computes for the positions alone."""
    from lorafleet_worker.model.rope import rope_cos_sin

    model = Transformer.from_pretrained(tiny_models["qwen3"], dtype=dtype)
    for positions in (torch.tensor([0, 3, 255]), torch.tensor([1000, 7, 600]), torch.tensor([5])):
        got = model._rope_tables(positions)
        want = rope_cos_sin(positions, model.inv_freq, model.rope_scale, dtype)
        assert all(torch.equal(g, w) and g.dtype == dtype and g.shape == (len(positions), 1, w.shape[-1])
                   for g, w in zip(got, want, strict=True))  # fmt: skip
    assert model._rope_cache is not None and model._rope_cache[0].shape[0] >= 1001
