"""bench/bench_gpu.py works without a GPU: argument parsing, peak table, kernel rows (interpreter), markdown,
and the model-shape roofline's arithmetic and adapters (bench/model_shape.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_arguments(bench: ModuleType) -> None:
    args = bench.parse_args(["--dry-run", "--num-seqs", "64"])
    assert args.out.name == "gpu.dry-run.json" and args.markdown.name == "gpu.dry-run.md"
    assert (args.num_seqs, args.max_tokens) == (2, 2)
    full = bench.parse_args(["--out", "/tmp/x.json", "--dtype", "float16"])
    assert (full.out, full.markdown, full.dtype, full.num_seqs) == (
        Path("/tmp/x.json"),
        Path("/tmp/x.md"),
        "float16",
        64,
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "int8"])


@pytest.mark.parametrize(
    ("name", "gbps"),
    [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-SXM4-40GB", 1555.0),
    ],
)
def test_device_peaks(bench: ModuleType, name: str, gbps: float) -> None:
    assert bench.device_peak(name)[0] == gbps


def test_unknown_device_has_no_peak(bench: ModuleType) -> None:
    assert bench.device_peak("NVIDIA GeForce GTX 1080") is None
    assert bench.device_peak(None) is None


def test_kernel_rows_and_markdown(bench: ModuleType, device: torch.device) -> None:
    timer = bench.timer_for(device)
    peak = (3350.0, 989.0)
    rows = [bench.bench_lora(s, torch.float16, device, timer, peak) for s in bench.DRY_LORA_SHAPES]
    rows += [bench.bench_attention(s, torch.float16, device, timer, peak) for s in bench.DRY_ATTN_SHAPES]
    assert {r["layout"] for r in rows if r["kernel"] == "lora_shrink_expand"} == {"gathered", "segmented"}
    for r in rows:
        assert r["bytes"] > 0 and r["flops"] > 0 and r["triton_us"] > 0 and r["torch_us"] > 0
        assert r["triton_GBps"] == pytest.approx(r["bytes"] / r["triton_us"] / 1e3, rel=0.02, abs=0.1)
        assert "triton_pct_peak_bw" in r
    e2e = [
        {"backend": "triton", "adapters": n, "num_seqs": 4, "decode_tokens_per_s": v}
        for n, v in ((0, 100.0), (16, 80.0))
    ]
    payload = {"device": "NVIDIA H100", "dtype": "float16", "dry_run": True, "peak": peak, "kernels": rows, "e2e": e2e}
    md = bench.markdown(payload)
    assert md.count("| qkv T=8") == 1 and "GQA=4" in md and "| triton | 16 | 4 | 80.0 | 0.80 |" in md


def test_refuses_to_run_without_cuda(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    assert bench.main(["--skip-e2e", "--out", "/nonexistent/x.json"]) == 2


def test_llama3_8b_shape_arithmetic(bench: ModuleType) -> None:
    """The roofline's sums for Llama-3-8B: 8.03B parameters, a bf16 step reads ~15 GB of weights."""
    from model_shape import LLAMA3_8B, adapter_bytes, decode_step_bytes, prefill_flops

    params = LLAMA3_8B.linear_params() + 2 * LLAMA3_8B.vocab_size * LLAMA3_8B.hidden_size
    assert params == pytest.approx(8.03e9, rel=0.005)
    assert LLAMA3_8B.kv_bytes_per_token(2) == 128 * 1024  # 32 layers x K,V x 8 heads x 128 x bf16
    step = decode_step_bytes(LLAMA3_8B, num_seqs=64, context=576, elem=2, adapter_ranks=[16] * 64)
    assert step["weights"] == pytest.approx(15.0e9, rel=0.01)
    assert step["kv"] == 64 * 576 * 128 * 1024
    assert step["lora"] == 64 * adapter_bytes(LLAMA3_8B, 16, 2) and step["lora"] == pytest.approx(5.37e9, rel=0.01)
    assert step["total"] == step["weights"] + step["kv"] + step["lora"]
    linear_only = 2 * LLAMA3_8B.linear_params() * 64 * 512
    assert linear_only < prefill_flops(LLAMA3_8B, num_seqs=64, prompt_len=512) < 1.1 * linear_only


def test_shape_adapter_is_a_peft_adapter(bench: ModuleType, tiny_models: Any, tmp_path: Path) -> None:
    """`write_peft_adapter` writes what PEFT itself loads for a model of that shape, every key used."""
    import json

    from model_shape import Shape, write_peft_adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    shape = Shape(
        "tiny",
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    adapter = write_peft_adapter(tmp_path / "a", shape, 8, seed=3)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    x = torch.tensor([[5, 6, 7, 8]])
    before = base(x).logits
    model = PeftModel.from_pretrained(base, adapter)
    loaded = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * 7 * shape.num_layers
    assert not torch.equal(model(x).logits, before)  # the adapter's weights took part


def test_profile_script_dry_run(tmp_path: Path) -> None:
    """bench/profile_gpu.py end to end on the tiny shape: one row per adapter count, steps and kernel tables."""
    spec = importlib.util.spec_from_file_location("profile_gpu", BENCH.parent / "profile_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "profile.json"
    assert module.main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["adapters"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["steps"] == 4 and row["wall_ms_per_step"] > 0
        if torch.cuda.is_available():
            assert row["kernels_per_step"] > 0 and row["top_kernels"]


def test_tile_sweep_rows(bench: ModuleType, device: torch.device) -> None:
    """The gathered kernels timed per candidate tile (dry run: two shrink tiles, one expand tile)."""
    rows = bench.tile_sweep(bench.DRY_LORA_SHAPES[0], torch.float16, device, bench.timer_for(device), True)
    assert [(r["kernel"], r["tile"]) for r in rows] == [("shrink", 16), ("shrink", 32), ("expand", 16)]
    assert all(r["us"] > 0 and r["group"] == "qkv" for r in rows)
    markdown = bench.markdown({"device": None, "dtype": "float16", "dry_run": True, "peak": None, "kernels": [],
                               "tile_sweep": rows, "e2e": []})  # fmt: skip
    assert "| qkv | expand | 16 | 4 |" in markdown
