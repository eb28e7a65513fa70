"""Quantized base linears (`model/quantization.py`, `--quantization`): weight-only int8 / int4, and w8a8_int8.

The kernels against a matmul with the dequantized weight; the quantization error within its bound; the
engine with quantized weights and LoRA on top against transformers + PEFT given the same dequantized
weights (w8a8_int8: and the prefill's activations rounded as the engine rounds them): same greedy tokens,
log-probs within 1e-3 (float32 activations), in one mixed batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.model import quantization
from lorafleet_worker.model.quantization import INT4_GROUP, quantize
from lorafleet_worker.ops import cpu_gemm
from lorafleet_worker.sample.params import SamplingParams
from torch import nn

from tests.worker.test_cpu_gemm import int8_blocks
from tests.worker.test_engine import peft_greedy

PROMPTS = [[5, 17, 42, 99, 3], [int(x) for x in torch.arange(30, 430, 10)]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r8": {"rank": 8, "seed": 11},
    "qv-r16": {"rank": 16, "seed": 12, "targets": ["q_proj", "v_proj"]},
}


@pytest.mark.parametrize("method", quantization.METHODS)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_matmul_is_x_times_the_dequantized_weight(method: str, dtype: torch.dtype, tol: float, rows: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128).to(dtype)
    qw = quantize(w, method)
    dense = qw.to_dense()
    assert dense.shape == w.shape and dense.dtype == dtype
    x = torch.randn(rows, 128).to(dtype)
    got = qw.matmul(x)
    # w8a8_int8: batches of more than one tile's rows multiply x rounded to int8 per 32 inputs (on CPUs with
    # AVX512-VNNI; elsewhere the op is the int8 panels' own)
    xs = int8_blocks(x) if method == "w8a8_int8" and rows > 6 and cpu_gemm.has_w8a8() else x.float()
    ref = xs @ dense.float().T
    assert got.dtype == dtype and got.shape == (rows, 96)
    assert (got.float() - ref).abs().max().item() < tol * ref.abs().max().item()
    assert qw.matmul(x.reshape(rows, 1, 128)).shape == (rows, 1, 96)  # leading dimensions kept
    if qw.panels:  # the decoder layer's direct call (int8 in panels): the same op, a bias added in x's dtype
        assert qw.matmul_2d is not None
        bias = torch.randn(96).to(dtype)
        assert torch.equal(qw.matmul_2d(x, None), got) and torch.equal(qw.matmul_2d(x, bias), got + bias)
    else:
        assert qw.matmul_2d is None


@pytest.mark.parametrize("method", quantization.METHODS)
def test_quantization_error_is_within_half_a_step(method: str) -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 256) * torch.linspace(0.01, 3, 64)[:, None]  # channels of very different ranges
    err = (quantize(w, method).to_dense() - w).abs()
    if method in quantization.INT8_METHODS:
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        g = w.reshape(64, -1, INT4_GROUP)
        step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(64, 256)
    assert (err <= step / 2 + 1e-5).all()
    assert err.max() > 0  # really quantized
    packed = quantize(w, method)
    assert packed.nbytes < w.nbytes / (3 if method in quantization.INT8_METHODS else 5)  # scales included


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown quantization 'fp8'"):
        quantize(torch.randn(4, 32), "fp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "int4")
    with pytest.raises(ValueError, match="bfloat16"):
        quantization.check_supported("int4", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="w8a8_int8 runs on CPUs with AVX512-VNNI, not on a CUDA device; use int8"):
        quantization.check_supported("w8a8_int8", torch.device("cuda"), torch.bfloat16)


def hf_with_weights_of(model_dir: Path, ours: Any) -> Any:
    """transformers' model of `model_dir` holding the (dequantized) weights our model computes with."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state, cfg = ours.state_dict(), ours.config
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            q, k, v = state[f"layers.{i}.qkv_w"].float().split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            gate, up = state[f"layers.{i}.gate_up_w"].float().chunk(2)
            attn, mlp = layer.self_attn, layer.mlp
            for lin, value in [(attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v), (mlp.gate_proj, gate),
                               (mlp.up_proj, up), (attn.o_proj, state[f"layers.{i}.o_w"].float()),
                               (mlp.down_proj, state[f"layers.{i}.down_w"].float())]:  # fmt: skip
                lin.weight.copy_(value)
    hf.lm_head.weight = nn.Parameter(ours.packed_head.to_dense().float())  # the embedding stays unquantized
    return hf


def round_prompt_rows(hf: Any) -> list[int]:
    """Make the base projections of `hf` (not the LoRA, not the lm_head) take the first n rows of their input
    rounded to int8 per 32 inputs, as w8a8_int8 does in a prefill of more than one tile (6) of rows, where a
    decode step of one sequence keeps x as it is. Returns [n], for the caller to set per prompt."""
    rows = [0]

    def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not rows[0]:
            return args
        x = args[0].clone()
        x[0, : rows[0]] = int8_blocks(x[0, : rows[0]])
        return (x,)

    for layer in hf.model.layers:
        for lin in (*(getattr(layer.self_attn, f"{p}_proj") for p in "qkvo"), layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):  # fmt: skip
            getattr(lin, "base_layer", lin).register_forward_pre_hook(hook)  # PEFT's wrapper: its base linear
    return rows


@pytest.mark.parametrize("method", quantization.METHODS)
async def test_engine_matches_peft_on_the_dequantized_weights(
    method: str, tiny_models: Any, tiny_adapter_factory: Any
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = Path(tiny_models["llama"])
    adapters = {name: tiny_adapter_factory(model_dir, **kw) for name, kw in ADAPTERS.items()}
    # w8a8_int8 rounds x only in a step of more than 6 rows: one sequence at a time makes that the prefill of a
    # prompt of more than 6 tokens, which PEFT's side then rounds the same way (`round_prompt_rows`)
    w8a8 = method == "w8a8_int8"
    if w8a8 and not cpu_gemm.has_w8a8():
        pytest.skip("w8a8_int8 runs on CPUs with AVX512-VNNI")
    engine = Engine(model_dir, dtype="float32", max_loras=2, block_size=4, max_model_len=128, num_kv_blocks=128,
                    quantization=method, max_num_seqs=1 if w8a8 else 64)  # fmt: skip
    assert len(engine.core.runner.model.packed_weights()) == 4 * engine.config.num_hidden_layers + 1
    assert engine.core.runner.model.layers[0].qkv_w.numel() == 0  # the dense copy is released
    await engine.start()
    try:
        for name, path in adapters.items():
            await engine.add_adapter(name, path)
        jobs = [(p, a) for p in PROMPTS for a in [None, *adapters]]

        async def run(i: int, prompt: list[int], adapter: str | None) -> tuple[list[int], list[float]]:
            outs = [o async for o in engine.generate(f"r{i}", prompt, GREEDY, adapter)]
            return [o.token_id for o in outs], [float(o.logprob or 0.0) for o in outs]

        results = await asyncio.wait_for(asyncio.gather(*(run(i, p, a) for i, (p, a) in enumerate(jobs))), 120)
        assert engine.stats.max_adapters_in_step == (1 if w8a8 else len(adapters))  # else one mixed batch
        hf = hf_with_weights_of(model_dir, engine.core.runner.model)
    finally:
        await engine.stop()
    names = list(adapters)
    peft = PeftModel.from_pretrained(hf, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    plain = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
        adapters[names[0]],
        adapter_name=names[0],
    )
    rounded = round_prompt_rows(hf) if w8a8 else [0]
    worst_vs_plain = 0.0
    for (prompt, adapter), (toks, lps) in zip(jobs, results, strict=True):
        rounded[0] = len(prompt) if len(prompt) > 6 else 0
        want_toks, want_lps = peft_greedy(peft.eval(), prompt, adapter, len(toks))
        assert toks == want_toks, (prompt, adapter)
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-3, (prompt, adapter)
        if adapter in (None, names[0]):
            _, plain_lps = peft_greedy(plain.eval(), prompt, adapter, 1)
            worst_vs_plain = max(worst_vs_plain, abs(plain_lps[0] - lps[0]))
    assert worst_vs_plain > 1e-3  # the unquantized weights would not have passed: the test sees quantization


def test_cli_flag_is_parsed_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from lorafleet_worker.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "m", "--quantization", "int4"]).quantization == "int4"
    assert parser.parse_args(["serve", "--model", "m", "-q", "w8a8_int8"]).quantization == "w8a8_int8"
    assert parser.parse_args(["serve", "--model", "m"]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--quantization", "fp8"])
    assert "--quantization" in capsys.readouterr().err


async def test_the_worker_serves_the_quantized_weights(tiny_models: Any) -> None:
    from lorafleet_worker.model.quantization import QuantizedWeight
    from lorafleet_worker.service import WorkerService, WorkerSettings

    settings = WorkerSettings(model_dir=Path(tiny_models["llama"]), served_model_name="m", quantization="int8")
    service = WorkerService(settings)
    await service.start()
    try:
        model = service.engine.core.runner.model
        assert all(isinstance(p, QuantizedWeight) and p.method == "int8" for p in model.layers[0].packed.values())
        assert isinstance(model.packed_head, QuantizedWeight)
    finally:
        await service.stop()


@pytest.mark.parametrize("method", quantization.METHODS)
def test_the_memory_plan_counts_quantized_weights_and_gives_the_kv_cache_what_they_free(
    method: str, tiny_models: Any
) -> None:
    # ~14 MiB of activations and 0.5 MiB of weights: the KV cache gets a few MiB, less than 64 sequences could use
    kw: dict[str, Any] = dict(dtype="float32", max_loras=0, max_num_seqs=64, memory_budget="17MiB")
    if method == "w8a8_int8" and not cpu_gemm.has_w8a8():
        pytest.skip("w8a8_int8 runs on CPUs with AVX512-VNNI")
    dense = Engine(tiny_models["llama"], **kw).core
    quantized = Engine(tiny_models["llama"], **kw, quantization=method).core
    assert quantized.memory_plan is not None and dense.memory_plan is not None
    assert quantized.memory_plan.weights == quantized.runner.model.weight_nbytes()
    assert quantized.memory_plan.weights < dense.memory_plan.weights / 2
    assert quantized.memory_plan.kv_blocks > dense.memory_plan.kv_blocks


def test_an_unsupported_quantization_is_refused_before_the_model_loads(tiny_models: Any) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'fp8'"):
        Engine(tiny_models["llama"], max_loras=0, num_kv_blocks=64, quantization="fp8")
