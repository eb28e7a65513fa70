# ruff: noqa: F811
"""Prefix caching end to end: with the cache, answers equal transformers + PEFT when the base model and several
adapters share a prefix (in turn and in one batch), through hot swaps, unload / reload, preemption, prompt
logprobs and a sliding window; and they would not if the adapter's identity were left out of the block hash."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.lora.manager import AdapterRef
from lorafleet_worker.sample.params import SamplingParams

# the fixtures come from test_engine (its engine factory, adapters and transformers + PEFT reference)
from tests.worker.test_engine import (  # noqa: F401
    ADAPTERS,
    GREEDY,
    EngineFactory,
    Reference,
    adapter_dir,
    assert_matches,
    collect,
    make_engine,
    reference,
)

SYSTEM = [int(x) for x in torch.arange(40, 440, 10)]  # 40 tokens: ten blocks of 4 shared by every request
SUFFIXES = [[3, 9, 27], [5, 25, 125, 111], [8, 64]]
NAMES: list[str | None] = [None, *ADAPTERS]


def prompts(i: int) -> list[int]:
    return SYSTEM + SUFFIXES[i]


async def engine_with_adapters(make: EngineFactory, adapter_dir: Callable[[str, str], Path], **kw: Any) -> Engine:
    engine = await make(**kw)
    for name in ADAPTERS:
        await engine.add_adapter(name, adapter_dir("llama", name))
    return engine


async def test_shared_prefix_across_base_and_adapters_matches_the_oracle(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await engine_with_adapters(make_engine, adapter_dir)
    for i in range(2):  # in turn: each adapter's first request follows the others' on the same prefix
        for name in NAMES:
            got = await collect(engine, f"seq-{i}-{name}", prompts(i), GREEDY, name)
            assert_matches(got, reference.greedy("llama", prompts(i), name))
    hits = engine.stats.prefix_cache_hits
    assert hits >= len(NAMES) * len(SYSTEM)  # the second round found each adapter's prefix
    # one batch, each adapter twice (as `n=2` sends it), on a prefix every adapter has cached
    jobs = [(name, 2) for name in NAMES for _ in range(2)]
    results = await asyncio.gather(
        *(collect(engine, f"batch-{k}", prompts(i), GREEDY, name) for k, (name, i) in enumerate(jobs))
    )
    for (name, i), got in zip(jobs, results, strict=True):
        assert_matches(got, reference.greedy("llama", prompts(i), name))
    assert engine.stats.prefix_cache_hits >= hits + len(jobs) * len(SYSTEM)
    assert engine.stats.max_adapters_in_step == len(ADAPTERS)


async def test_without_the_adapter_identity_in_the_hash_answers_would_be_wrong(
    make_engine: EngineFactory,
    reference: Reference,
    adapter_dir: Callable[[str, str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check above is sensitive: with every adapter hashed alike, an adapter reuses the base model's KV."""
    monkeypatch.setattr(AdapterRef, "identity", property(lambda self: b""))
    engine = await engine_with_adapters(make_engine, adapter_dir)
    await collect(engine, "base", prompts(0), GREEDY)
    got = await collect(engine, "adapter", prompts(0), GREEDY, "r64")
    assert engine.stats.prefix_cache_hits >= len(SYSTEM)
    with pytest.raises(AssertionError):
        assert_matches(got, reference.greedy("llama", prompts(0), "r64"))


async def test_hot_swap_and_back_and_unload_reload_never_reuse_other_weights(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await make_engine()
    steps = [("load", "r4"), ("swap", "r16-rslora"), ("swap", "r4"), ("unload-reload", "r64")]
    hits_before_swap_back = 0
    for action, weights in steps:
        if action == "unload-reload":
            assert await engine.remove_adapter("tenant")
            await engine.add_adapter("tenant", adapter_dir("llama", weights))
        else:
            await engine.add_adapter("tenant", adapter_dir("llama", weights), replace=action == "swap")
        if (action, weights) == ("swap", "r4"):
            hits_before_swap_back = engine.stats.prefix_cache_hits
        got = await collect(engine, f"{action}-{weights}", prompts(0), GREEDY, "tenant")
        assert_matches(got, reference.greedy("llama", prompts(0), weights))
        if (action, weights) == ("swap", "r4"):  # the same weights again: their KV is valid and found
            assert engine.stats.prefix_cache_hits >= hits_before_swap_back + len(SYSTEM)


async def test_preemption_under_kv_pressure_with_a_shared_prefix(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await engine_with_adapters(make_engine, adapter_dir, num_kv_blocks=26, max_model_len=64)
    jobs = [(name, i) for i in range(2) for name in NAMES]
    results = await asyncio.gather(
        *(collect(engine, f"r{k}", prompts(i), GREEDY, name) for k, (name, i) in enumerate(jobs))
    )
    for (name, i), got in zip(jobs, results, strict=True):
        assert_matches(got, reference.greedy("llama", prompts(i), name))
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert engine.stats.kv_blocks_free == engine.stats.kv_blocks_total  # cached blocks nobody holds are free


async def test_cache_on_and_off_give_the_same_sampled_answers(make_engine: EngineFactory) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, logprobs=2)
    answers = []
    for enabled in (True, False):
        engine = await make_engine(enable_prefix_caching=enabled)
        runs = [await collect(engine, f"{enabled}-{k}", prompts(0), params) for k in range(2)]
        # the same tokens; log-probs up to float rounding (a cached prefix changes the matmul shapes, and
        # some CPUs' kernels round differently per shape)
        assert_matches(runs[1], runs[0])
        answers.append(runs[0])
        assert (engine.stats.prefix_cache_hits > 0) is enabled
    assert answers[0][0] == answers[1][0]
    assert max(abs(a - b) for a, b in zip(answers[0][1], answers[1][1], strict=True)) < 1e-3


async def test_prompt_logprobs_are_exact_on_a_cached_prompt(tiny_models: Any) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([prompts(0)])).logits[0, :-1].float(), -1)
    engine = Engine(tiny_models["llama"], max_loras=0, block_size=4, max_model_len=128, max_num_batched_tokens=16)
    await engine.start()
    try:
        await collect(engine, "warm", prompts(0), GREEDY)
        outs = [o async for o in engine.generate("echo", prompts(0), SamplingParams(max_tokens=0, prompt_logprobs=1))]
        assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(prompts(0)) - 1
        for i, (lp, _, _) in enumerate(outs[0].prompt_logprobs):
            assert lp == pytest.approx(float(rows[i, prompts(0)[i + 1]]), abs=1e-3)
    finally:
        await engine.stop()


async def test_sliding_window_model_with_the_cache_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=6,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "mistral")
    ids, want = list(prompts(0)), []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            t = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            want.append(t)
            ids.append(t)
    engine = Engine(tmp_path / "mistral", max_loras=0, block_size=4, max_model_len=128)
    await engine.start()
    try:
        for k in range(2):
            got = await collect(engine, f"w{k}", prompts(0), GREEDY)
            assert got[0] == want
        assert engine.stats.prefix_cache_hits >= len(SYSTEM)
    finally:
        await engine.stop()
