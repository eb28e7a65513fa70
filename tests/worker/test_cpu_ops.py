"""The C++ small ops of a decoder layer (`ops/cpu_attention.py`) against the torch code they replace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lorafleet_worker.model import Transformer
from lorafleet_worker.model import transformer as transformer_mod
from lorafleet_worker.model.rope import apply_rope, rope_cos_sin
from lorafleet_worker.model.transformer import RMSNorm
from lorafleet_worker.ops import cpu_attention

from tests.worker.test_model import CHUNKS, our_logprobs

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU ops do not build")

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and (a.float() - b.float()).abs().max().item() <= tol * max(1.0, b.float().abs().max().item())
    )


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 8), (5, 37), (33, 768)])
def test_rms_norm_and_add(dtype: torch.dtype, tol: float, rows: int, dim: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim).to(dtype)
    h, delta = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    assert close(cpu_attention.rms_norm(h, norm.weight, norm.eps), norm(h), tol)
    ref_h = h + delta
    ref = norm(ref_h)
    got = cpu_attention.add_rms_norm_(h, delta, norm.weight, norm.eps)
    assert torch.equal(h, ref_h)  # the residual add is in place and rounds like torch's
    assert close(got, ref, tol)
    strided = torch.randn(rows, 2 * dim).to(dtype)[:, :dim]  # rows of a wider buffer
    assert close(cpu_attention.rms_norm(strided, norm.weight, norm.eps), norm(strided), tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 3), (7, 17), (32, 2304)])
def test_silu_mul(dtype: torch.dtype, tol: float, rows: int, inter: int) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(rows, 2 * inter) * 6).to(dtype)  # far into both tails of the sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    assert close(cpu_attention.silu_mul(gate_up), F.silu(gate) * up, tol)
    assert torch.isfinite(cpu_attention.silu_mul(torch.tensor([[-200.0, 200.0, 1.0, 1.0]]).to(dtype))).all()
    nan = torch.ones(1, 20).to(dtype)
    nan[0, [0, 9]] = float("nan")  # a vector lane and the scalar tail: NaN stays NaN, no other value touched
    assert torch.isnan(cpu_attention.silu_mul(nan)[0]).tolist() == [i in (0, 9) for i in range(10)]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(1, 2), (3, 10), (12, 64)])
def test_rope_in_place_on_qkv_views(dtype: torch.dtype, tol: float, heads: int, head_dim: int) -> None:
    torch.manual_seed(2)
    rows, kv_heads = 9, 1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_cos_sin(torch.arange(rows) * 7 + 3, inv_freq, 1.0, dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(rows, heads, head_dim), k.reshape(rows, kv_heads, head_dim)
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    before_v = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cpu_attention.rope_(q, cos, sin)
    cpu_attention.rope_(k, cos, sin)
    assert close(q, ref_q, tol) and close(k, ref_k, tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before_v)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_with_and_without_the_fused_ops(
    tiny_models: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The whole forward pass agrees with the torch small ops (the fallback where the extension is absent)."""
    model = Transformer.from_pretrained(Path(tiny_models["llama"]), dtype=dtype, attn_backend="cpu")
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 311, 64, 12, 1, 77, 140, 33, 21, 9]
    fused = our_logprobs(model, prompt)
    monkeypatch.setattr(transformer_mod, "_fused_ops", lambda h: False)
    plain = our_logprobs(model, prompt)
    tol = 1e-4 if dtype == torch.float32 else 0.15
    assert (fused - plain).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: qkv bias; qwen3: per-head q/k norms
@pytest.mark.parametrize("linears", ["panel", "split", "onednn", "torch"])  # LORAFLEET_CPU_LINEAR: every GEMM path
def test_decode_fast_path_gives_the_bits_of_the_layer_forward(
    tiny_models: Any, monkeypatch: pytest.MonkeyPatch, arch: str, dtype: torch.dtype, linears: str
) -> None:
    """A CPU step (prompt chunks and decode tokens alike: every row a query of the paged kernel) runs the lean
    loop over `CpuDecodeLayer`s, with the same logits, bit for bit, as `DecoderLayer.forward` (what a profiler's
    `ForwardOps(direct=False)` times instead), whichever path serves the base GEMMs."""
    from lorafleet_worker.model import cpu_linear
    from lorafleet_worker.ops import cpu_gemm

    if linears in ("panel", "split") and not cpu_gemm.available():
        pytest.skip("the panel GEMM does not build here")
    monkeypatch.setenv(cpu_linear.ENV, linears)
    model = Transformer.from_pretrained(Path(tiny_models[arch]), dtype=dtype, attn_backend="cpu")
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("_b"):  # the tiny checkpoints' biases are zeros: make them count
            param.data.normal_()
    assert model.cpu_decode_layers() is not None
    calls = []
    lean = transformer_mod._decode_on_cpu
    monkeypatch.setattr(transformer_mod, "_decode_on_cpu", lambda *a: calls.append(1) or lean(*a))
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 311, 64, 12, 1, 77, 140, 33, 21, 9]
    fast = our_logprobs(model, prompt)
    assert len(calls) == len(CHUNKS)  # every chunk of `our_logprobs`: two prompt chunks, four decode steps
    model.set_ops(transformer_mod.ForwardOps(direct=False))
    generic = our_logprobs(model, prompt)
    assert len(calls) == len(CHUNKS)
    assert torch.equal(fast, generic)


def test_repacking_drops_the_decode_plan(tiny_models: Any) -> None:
    """Quantizing after a decode step rebuilds the plan from the new weights (no stale GEMM is called)."""
    model = Transformer.from_pretrained(Path(tiny_models["llama"]), dtype=torch.bfloat16, attn_backend="cpu")
    before = model.cpu_decode_layers()
    model.quantize_weights("int8")
    after = model.cpu_decode_layers()
    assert before is not None and after is not None and after is not before
    assert after[0].qkv is not before[0].qkv
