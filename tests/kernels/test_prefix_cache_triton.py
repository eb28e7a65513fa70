"""Prefix caching on the Triton path (interpreted on CPU, compiled on a GPU machine; fp32): cached-prefix
answers equal the torch path's without the cache, for the base model and two adapters that share a prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

SHARED = [5, 17, 42, 99, 7, 63, 120, 11, 250, 31, 8, 77, 140, 3, 19, 56]  # four blocks of 4
SUFFIXES = [[200, 64], [12, 90, 33]]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)


async def _answers(
    model: Path, adapters: dict[str, Path], backend: str, caching: bool, device: torch.device
) -> tuple[list, int]:
    engine = Engine(
        model,
        device=device.type,
        dtype="float32",
        max_loras=2,
        max_lora_rank=8,
        lora_backend=backend,
        block_size=4,
        enable_prefix_caching=caching,
    )
    await engine.start()
    try:
        for name, path in adapters.items():
            await engine.add_adapter(name, path)
        out = []
        for suffix in SUFFIXES:
            for name in [None, *adapters]:
                toks = [t async for t in engine.generate(f"{name}-{suffix}", SHARED + suffix, PARAMS, adapter=name)]
                out.append(([t.token_id for t in toks], [t.logprob for t in toks]))
        return out, engine.stats.prefix_cache_hits
    finally:
        await engine.stop()


async def test_triton_engine_with_cached_prefixes_matches_torch_without(tmp_path: Path, device: torch.device) -> None:
    model = make_tiny_model(tmp_path / "model", "llama", num_heads=4, num_kv_heads=1, seed=3)
    adapters = {
        "r2": make_tiny_adapter(tmp_path / "r2", model, rank=2, seed=1),
        "r8": make_tiny_adapter(tmp_path / "r8", model, rank=8, seed=2),
    }
    want, _ = await _answers(model, adapters, "torch", caching=False, device=device)
    got, hits = await _answers(model, adapters, "triton", caching=True, device=device)
    assert hits >= 3 * len(SHARED)  # the second suffix of each found its prefix
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(gl, wl, strict=True)) == pytest.approx(0, abs=1e-3)
