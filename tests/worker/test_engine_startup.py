"""Engine start-up: what `auto` picks (dtype, LoRA backend), the memory budget and the KV cache sized from it."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.core.memory import GiB, MemoryBudget, MemoryBudgetError, fmt_bytes, plan_memory
from lorafleet_worker.host import devices
from lorafleet_worker.ops import cpu_attention
from lorafleet_worker.sample.params import SamplingParams

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_bf16_flag_reads_cpuinfo(tmp_path: Path) -> None:
    read = devices.cpu_bf16_flag.__wrapped__  # uncached
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_tile amx_bf16 avx512_bf16\n")
    assert read(info) == "amx_bf16"
    info.write_text("flags\t\t: fpu sse avx2\n")
    assert read(info) in (None, "avx512_bf16")  # the fallback asks torch about this very CPU


@pytest.mark.parametrize(
    ("requested", "stored", "device", "bf16_cpu", "want"),
    [
        ("bf16", "float32", CPU, None, "bfloat16"),  # an explicit choice wins
        ("auto", "bfloat16", CUDA, None, "bfloat16"),
        ("auto", "float16", CUDA, None, "float16"),
        ("auto", "float32", CUDA, None, "bfloat16"),  # like vLLM: 16 bits on GPU
        ("auto", "bfloat16", CPU, "amx_bf16", "bfloat16"),
        ("auto", "float16", CPU, "avx512_bf16", "bfloat16"),
        ("auto", "bfloat16", CPU, None, "float32"),  # emulated bf16 is slower than fp32
        ("auto", "float32", CPU, "amx_bf16", "float32"),  # never below the checkpoint's precision on CPU
        ("auto", None, CPU, None, "float32"),
    ],
)
def test_auto_dtype(
    monkeypatch: pytest.MonkeyPatch, requested: str, stored: str | None, device: Any, bf16_cpu: str | None, want: str
) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_flag", lambda: bf16_cpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    dtype, why = devices.resolve_dtype(requested, stored, device)
    assert dtype == want and why


def test_auto_lora_backend() -> None:
    assert devices.resolve_lora_backend("auto", CUDA)[0] == "triton"
    assert devices.resolve_lora_backend("auto", CPU)[0] == "torch"
    assert devices.resolve_lora_backend("triton", CPU)[0] == "triton"


@pytest.mark.parametrize(
    ("text", "fraction", "nbytes"),
    [("0.9", 0.9, None), ("1", 1.0, None), ("8GiB", None, 8 * GiB), ("16G", None, 16 * 10**9),
     ("512Mi", None, 512 << 20), ("1.5Gi", None, 3 * GiB // 2), ("4096", None, 4096)],
)  # fmt: skip
def test_memory_budget_parses_fractions_and_sizes(text: str, fraction: float | None, nbytes: int | None) -> None:
    assert MemoryBudget.parse(text) == MemoryBudget(fraction=fraction, nbytes=nbytes)


@pytest.mark.parametrize("text", ["0", "-0.5", "1.5", "lots", "8 GiBs", ""])
def test_memory_budget_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="fraction in \\(0, 1\\] or a size"):
        MemoryBudget.parse(text)


def test_memory_budget_fraction_of_cpu_memory() -> None:
    nbytes, source = MemoryBudget.parse("0.5").resolve(CPU)
    assert nbytes > 0 and source.startswith("0.5 of ")


PLAN = dict(budget_source="test", weights=100, lora=20, activations=30, bytes_per_block=10, block_size=4)


def test_plan_gives_the_kv_cache_what_is_left_up_to_what_the_sequences_can_use() -> None:
    plan = plan_memory(budget=1000, max_model_len=16, max_num_seqs=100, **PLAN)  # type: ignore[arg-type]
    assert plan.kv_blocks == 85 and plan.kv == 850 and plan.kv_tokens == 340  # (1000 - 150) // 10
    capped = plan_memory(budget=1000, max_model_len=16, max_num_seqs=2, **PLAN)  # type: ignore[arg-type]
    assert capped.kv_blocks == 8  # 2 sequences x 4 blocks
    short = plan_memory(budget=1000, max_model_len=16, max_num_seqs=100, free=250, **PLAN)  # type: ignore[arg-type]
    assert short.kv_blocks == 10  # the device has only 250 bytes free
    assert "85 blocks x 4 tokens (340 tokens, 21.2 sequences" in plan.describe(16)


def test_plan_that_cannot_hold_one_sequence_names_the_flags() -> None:
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(budget=180, max_model_len=16, max_num_seqs=1, **PLAN)  # type: ignore[arg-type]
    msg = str(e.value)
    for flag in ("--gpu-memory-utilization", "--memory-budget", "--max-model-len", "--max-loras", "--max-lora-rank"):
        assert flag in msg
    assert "at most 12 fits" in msg  # 30 bytes left = 3 blocks = 12 tokens


def test_engine_logs_its_choices_and_sizes_the_kv_cache_from_the_budget(
    tiny_models: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lorafleet_worker.core")
    engine = Engine(tiny_models["llama"], max_loras=2, max_lora_rank=8, max_num_seqs=4, memory_budget="64MiB")
    assert engine.core.dtype == torch.float32 and engine.core.lora_backend_name == "torch"  # fp32 checkpoint on CPU
    # decode attention reads the KV blocks in place where the C++ loop builds; the log names the choice
    assert engine.core.runner.model.attn_backend == ("cpu" if cpu_attention.available() else "torch")
    assert f"decode attention: {engine.core.runner.model.attn_backend}" in caplog.text
    assert engine.max_model_len == engine.config.max_position_embeddings
    plan = engine.core.memory_plan
    assert plan is not None and plan.budget == 64 << 20
    assert engine.core.runner.kv.num_blocks == plan.kv_blocks and engine.core.runner.kv.nbytes == plan.kv
    assert plan.weights == engine.core.runner.model.weight_nbytes()  # packed weights (CPU) included
    assert engine.manager is not None and plan.lora == engine.manager.pool.nbytes
    assert plan.weights + plan.lora + plan.activations + plan.kv <= plan.budget
    assert plan.kv_blocks == 4 * engine.max_model_len // 16  # capped at what 4 sequences can use
    text = caplog.text
    assert "dtype float32: the checkpoint's torch_dtype (float32) on CPU" in text
    assert "LoRA backend torch: cpu" in text
    # 0.5 MiB in one packed layout, 0.9 MiB in cpu_linear's split mode (AVX-512: panels and oneDNN)
    assert (
        plan.weights < (1 << 20)
        and f"memory budget 64.0 MiB (64.0 MiB as set): weights {fmt_bytes(plan.weights)}" in text
    )


def test_engine_refuses_a_budget_that_cannot_hold_one_sequence(tiny_models: Any) -> None:
    with pytest.raises(MemoryBudgetError, match="--max-model-len"):
        Engine(tiny_models["llama"], max_loras=0, memory_budget="15MiB")
    Engine(tiny_models["llama"], max_loras=0, memory_budget="15MiB", max_model_len=64)  # a shorter context fits


def test_max_model_len_above_max_position_embeddings_is_refused(tiny_models: Any) -> None:
    limit = json.loads((tiny_models["llama"] / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"larger than the model's max_position_embeddings \\({limit}"):
        Engine(tiny_models["llama"], max_loras=0, max_model_len=limit + 1)


async def _greedy_batch(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        return [o.token_id async for o in engine.generate(f"r{i}", prompt, params)]

    await engine.start()
    try:
        async with asyncio.timeout(120):
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.stop()


async def test_garbage_in_the_uninitialised_kv_pool_never_reaches_attention(tiny_models: Any, tmp_path: Path) -> None:
    """Sequences of 1, 5 and 19 tokens decode together (padded block tables, part-filled last blocks)."""
    prompts = [[7], [5, 17, 42, 99, 3], list(range(30, 220, 10))]
    opts: dict[str, Any] = {"max_loras": 0, "block_size": 4, "max_model_len": 64, "num_kv_blocks": 64}
    clean = await _greedy_batch(Engine(tiny_models["llama"], **opts), prompts)
    dirty_engine = Engine(shutil.copytree(tiny_models["llama"], tmp_path / "m"), **opts)
    for t in (*dirty_engine.core.runner.kv.k_caches, *dirty_engine.core.runner.kv.v_caches):
        t[1:].fill_(float("nan"))  # block 0 (table padding) is zeroed at start; the rest is what memory held
    assert await _greedy_batch(dirty_engine, prompts) == clean
