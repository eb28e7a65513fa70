"""The engine with the Triton LoRA backend and attention kernel (interpreted on CPU) matches the torch path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from lorafleet_worker.devtools import make_tiny_adapter, make_tiny_model
from lorafleet_worker.engine import Engine
from lorafleet_worker.kernels import paged_attention
from lorafleet_worker.lora.batch import LoRABatchInfo
from lorafleet_worker.lora.triton_backend import TritonLoRABackend
from lorafleet_worker.sampling import SamplingParams, TokenOutput

PROMPT = [5, 17, 42, 99, 7, 63, 120, 11, 250, 31, 8, 77, 140, 3, 19, 56, 200, 64, 12, 90]
MAX_TOKENS = 6
LOGPROB_TOL = 1e-3  # fp32


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("triton-engine")
    model = make_tiny_model(root / "model", "llama", num_heads=4, num_kv_heads=1, seed=3)
    adapters = {
        "r2": make_tiny_adapter(root / "r2", model, rank=2, seed=1),
        "r16": make_tiny_adapter(root / "r16", model, rank=16, rank_pattern={"k_proj": 4, "down_proj": 8}, seed=2),
        "qv8": make_tiny_adapter(root / "qv8", model, rank=8, targets=("q_proj", "v_proj"), seed=3),
    }
    return model, adapters


async def _run(model: Path, adapters: dict[str, Path], backend: str) -> tuple[dict[str | None, list[TokenOutput]], int]:
    engine = Engine(model, device="cpu", dtype="float32", max_loras=4, max_lora_rank=16, lora_backend=backend)
    assert engine.model.attn_backend == backend  # the paged-attention kernel goes with the Triton backend
    await engine.start()
    try:
        for name, path in adapters.items():
            await engine.add_adapter(name, path)
        names: list[str | None] = [None, *adapters]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)

        async def collect(i: int, name: str | None) -> list[TokenOutput]:
            return [t async for t in engine.generate(f"req-{i}", PROMPT, params, adapter=name)]

        outs = await asyncio.gather(*(collect(i, n) for i, n in enumerate(names)))
        return dict(zip(names, outs, strict=True)), engine.stats.max_adapters_in_step
    finally:
        await engine.stop()


async def test_triton_engine_matches_torch_on_a_mixed_adapter_batch(
    model_and_adapters: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, adapters = model_and_adapters
    torch_out, _ = await _run(model, adapters, "torch")

    layouts: set[bool] = set()
    attn_calls = 0
    pick_layout = TritonLoRABackend.use_gathered
    attn_kernel = paged_attention.paged_attention_decode

    def recording_pick(self: TritonLoRABackend, batch: LoRABatchInfo) -> bool:
        gathered = pick_layout(self, batch)
        layouts.add(gathered)
        return gathered

    def counting_attn(*args: Any, **kwargs: Any) -> Any:
        nonlocal attn_calls
        attn_calls += 1
        return attn_kernel(*args, **kwargs)

    monkeypatch.setattr(TritonLoRABackend, "use_gathered", recording_pick)
    monkeypatch.setattr(paged_attention, "paged_attention_decode", counting_attn)
    triton_out, max_adapters = await _run(model, adapters, "triton")

    assert max_adapters >= 2, "the requests never shared a step"
    assert layouts == {True, False}, "prefill should use the segmented and decode the gathered kernels"
    assert attn_calls > 0
    for name, expected in torch_out.items():
        got = triton_out[name]
        assert [t.token_id for t in got] == [t.token_id for t in expected], f"adapter {name}"
        for g, e in zip(got, expected, strict=True):
            assert abs(g.logprob - e.logprob) < LOGPROB_TOL, f"adapter {name}: {g.logprob} vs {e.logprob}"
    # the adapters really change the output, so the comparison covers the LoRA path
    base = [t.token_id for t in torch_out[None]]
    assert sum([t.token_id for t in torch_out[n]] != base for n in adapters) >= 2
