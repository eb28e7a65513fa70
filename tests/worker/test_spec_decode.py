# ruff: noqa: F811
"""Speculative decoding (n-gram drafts verified in one forward pass): greedy answers equal those without it
(mixed adapters in one batch, prefix caching, stop tokens, length limits, logprobs, structured output), the
rejection rule keeps the sampling distribution, speculation backs off under load, and the counters count."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker.sample.rejection import verify
from lorafleet_worker.sample.sampler import SamplingState
from lorafleet_worker.spec_decode.config import SpeculativeConfig
from lorafleet_worker.spec_decode.ngram import NgramProposer
from lorafleet_worker.structured.grammar import JsonSchema, Regex

# the fixtures come from test_engine (its engine factory, adapters and transformers + PEFT reference)
from tests.worker.test_engine import (  # noqa: F401
    ADAPTERS,
    EngineFactory,
    Reference,
    adapter_dir,
    collect,
    make_engine,
    reference,
)

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=64)
# prompts that repeat themselves, so that prompt lookup finds n-grams (the tiny models' greedy text loops too)
PROMPTS = [[5, 6, 7, 8] * 4 + [5, 6], [11, 12, 13] * 5, [40, 41, 42, 43, 44, 40, 41]]
NAMES: list[str | None] = [None, *ADAPTERS]


async def engine_with_adapters(make: EngineFactory, adapter_dir: Callable[[str, str], Path], **kw: Any) -> Engine:
    engine = await make(**kw)
    for name in ADAPTERS:
        await engine.add_adapter(name, adapter_dir("llama", name))
    return engine


# ----------------------------------------------------------------------------------- the proposer and its config


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() -> None:
    p = NgramProposer(2, 4, 3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]
    assert p.propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]  # the most recent occurrence
    assert p.propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], k=1) == [7]
    assert p.propose([5, 6, 7, 8]) == []  # no n-gram recurs
    assert p.propose([256, 1, 1, 2, 256, 1]) == [1, 2, 256]  # ids packed in words: no match across tokens
    assert NgramProposer(3, 3, 2).propose([1, 2, 9, 1, 2]) == []  # the 2-gram is below prompt_lookup_min


def test_speculative_config_parses_vllm_keys_and_names_what_is_wrong() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 3, 3)
    assert cfg.disable_by_batch_size == 4
    for text, match in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"num_speculative_tokens": 2, "bogus": 1}', "bogus"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ("[1]", "object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(text)


# ----------------------------------------------------------------------------------- the rejection rule


def _state(temperature: float, seed: int | None = None, **kw: Any) -> SamplingState:
    return SamplingState.create(SamplingParams(temperature=temperature, seed=seed, **kw), [1])


def test_rejection_rule_keeps_the_target_distribution() -> None:
    """Many sequences, each with the same two-token draft over the same rows: the first kept token is
    distributed as row 0's p; given that the draft's first token was kept, the second is distributed as row 1's."""
    vocab, n = 6, 6000
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, vocab, generator=gen) * 1.5
    draft = [2, 4]
    p0 = torch.softmax(rows[0] / 0.7, -1)
    p1 = torch.softmax(rows[1] / 0.7, -1)
    logits = rows.repeat(n, 1)
    torch.manual_seed(0)  # unseeded requests draw from the global generator
    kept = verify(logits, [_state(0.7)] * n, [draft] * n)
    first = torch.bincount(torch.tensor([k[0].token_id for k in kept]), minlength=vocab).float() / n
    seconds = [k[1].token_id for k in kept if k[0].token_id == draft[0]]
    second = torch.bincount(torch.tensor(seconds), minlength=vocab).float() / len(seconds)
    assert 0.5 * float((first - p0).abs().sum()) < 0.03  # total variation
    assert 0.5 * float((second - p1).abs().sum()) < 0.05
    assert all(1 <= len(k) <= 3 for k in kept)
    assert any(len(k) == 3 for k in kept)  # the bonus token after a fully accepted draft


def test_greedy_verification_keeps_the_argmax_prefix_and_forced_drafts_are_kept() -> None:
    logits = torch.full((4, 5), -5.0)
    for r, t in enumerate([1, 2, 3, 0]):
        logits[r, t] = 5.0
    greedy = _state(0.0, logprobs=1)
    kept = verify(logits, [greedy], [[1, 2, 4]])[0]
    assert [t.token_id for t in kept] == [1, 2, 3]  # 4 rejected: row 2's argmax replaces it
    assert kept[0].top_logprobs is not None and set(kept[0].top_logprobs) == {1}
    forced = verify(logits, [greedy], [[4, 4, 4]], forced=[True])[0]
    assert [t.token_id for t in forced] == [4, 4, 4, 0]


# ----------------------------------------------------------------------------------- the engine


async def test_greedy_equals_no_speculation_with_mixed_adapters_in_one_batch(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    """Every adapter and the base model on repetitive prompts in one batch, twice (the second time from the
    prefix cache the first filled), with logprobs: tokens equal transformers + PEFT's greedy ones, and drafts
    were really accepted."""
    engine = await engine_with_adapters(make_engine, adapter_dir, speculative_config=SPEC, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    jobs = [(p, a) for p in PROMPTS for a in NAMES]
    for round_ in range(2):
        results = await asyncio.gather(
            *(collect(engine, f"r{round_}-{i}", p, params, a) for i, (p, a) in enumerate(jobs))
        )
        for (prompt, adapter), got in zip(jobs, results, strict=True):
            want = reference.greedy("llama", prompt, adapter, 10)
            assert got[0] == want[0] and got[2] == "length"
            assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    st = engine.stats
    assert st.spec_drafts > 0 and st.spec_accepted_tokens > 0
    assert st.spec_accepted_tokens == sum(st.spec_accepted_per_pos) <= st.spec_draft_tokens
    assert st.prefix_cache_hits > 0 and st.max_adapters_in_step == len(ADAPTERS)
    assert st.kv_blocks_free == st.kv_blocks_total


async def test_cached_blocks_hold_only_accepted_tokens(make_engine: EngineFactory, reference: Reference) -> None:
    """A request whose prompt is an earlier speculative request's prompt and answer starts from the blocks
    that request cached, and continues as transformers does."""
    engine = await make_engine(max_loras=0, speculative_config=SPEC)
    prompt = PROMPTS[0]
    first, _, _ = await collect(engine, "first", prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    assert engine.stats.spec_accepted_tokens > 0
    again = prompt + first
    hits = engine.stats.prefix_cache_hits
    got, _, _ = await collect(engine, "again", again, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert engine.stats.prefix_cache_hits - hits >= (len(prompt) + 12) // 4 * 4
    assert got == reference.greedy("llama", again, None, 6)[0]


async def test_stop_tokens_and_length_limits_cut_inside_a_draft(
    make_engine: EngineFactory, reference: Reference
) -> None:
    prompt = PROMPTS[1]
    want, _, _ = reference.greedy("llama", prompt, None, 12)
    engine = await make_engine(max_loras=0, speculative_config=SPEC, max_model_len=len(prompt) + 9)
    stop = want[5]
    toks, _, reason = await collect(engine, "stop", prompt, SamplingParams(temperature=0, stop_token_ids=[stop]))
    assert toks == want[: want.index(stop) + 1] and reason == "stop"
    for n in range(1, 8):
        toks, _, reason = await collect(
            engine, f"max{n}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
        assert toks == want[:n] and reason == "length"
    toks, _, reason = await collect(
        engine, "len", prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    assert toks == want[:9] and reason == "length"  # max_model_len cuts before max_tokens
    assert engine.stats.spec_accepted_tokens > 0


async def test_sampled_requests_with_speculation_finish_and_are_seeded(make_engine: EngineFactory) -> None:
    engine = await make_engine(max_loras=0, speculative_config=SPEC)
    params = SamplingParams(max_tokens=12, temperature=0.3, seed=3, ignore_eos=True, logprobs=1)
    # one after the other: a seed gives the same answer where the drafts are the same (they depend on the batch)
    a = await collect(engine, "s0", PROMPTS[0], params)
    b = await collect(engine, "s1", PROMPTS[0], params)
    assert a[0] == b[0] and len(a[0]) == 12 and a[2] == "length"
    assert engine.stats.spec_drafts > 0


async def test_speculation_backs_off_while_many_requests_run(make_engine: EngineFactory) -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=2)
    engine = await make_engine(max_loras=0, speculative_config=cfg, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    await asyncio.gather(*(collect(engine, f"b{i}", p, params) for i, p in enumerate([*PROMPTS, PROMPTS[0]])))
    assert engine.stats.spec_drafts == 0  # four ran together from their first step to their last
    await collect(engine, "alone", PROMPTS[0], params)
    assert engine.stats.spec_drafts > 0


@pytest.mark.parametrize("jump_forward", [False, True])
async def test_structured_output_with_drafts_equals_constrained_decoding(
    make_engine: EngineFactory, jump_forward: bool
) -> None:
    """Drafts are cut where the grammar rejects them, and forced tokens (jump-forward) are kept: the greedy
    answer is the one constrained decoding gives without either."""
    schema = {
        "type": "object",
        "properties": {"customer_name": {"type": "string", "maxLength": 12}, "order_number": {"type": "integer"}},
        "required": ["customer_name", "order_number"],
    }
    constraints = [JsonSchema.of(schema, "response_format"), Regex("(ab|cd){3}[0-9]{2}xyz", "guided_regex")]
    params = SamplingParams(max_tokens=40, temperature=0)
    plain = await make_engine(max_loras=0)
    spec = await make_engine(max_loras=0, speculative_config=SPEC, jump_forward=jump_forward)
    for i, constraint in enumerate(constraints):
        for prompt in PROMPTS:
            want = await _constrained(plain, f"p{i}", prompt, params, constraint)
            got = await _constrained(spec, f"s{i}", prompt, params, constraint)
            assert got[0] == want[0] and got[2] == want[2]
            assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    st = spec.stats
    assert st.spec_drafts > 0
    if jump_forward:  # forced runs (the keys) came in one step each
        assert st.generation_tokens - st.spec_accepted_tokens > st.steps


async def _constrained(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, constraint: Any) -> Any:
    grammar = await asyncio.to_thread(engine.compile, constraint)
    toks, lps, reason = [], [], None
    async for out in engine.generate(f"{rid}-{len(prompt)}-{prompt[0]}", prompt, params, grammar=grammar):
        toks.append(out.token_id)
        lps.append(out.logprob)
        reason = out.finish_reason
    return toks, lps, reason


def test_metrics_carry_vllms_speculative_decoding_counters() -> None:
    from lorafleet_worker.core.scheduler import SchedulerStats
    from lorafleet_worker.metrics import WorkerMetrics

    stats = SchedulerStats(spec_drafts=5, spec_draft_tokens=15, spec_accepted_tokens=7, spec_accepted_per_pos=(4, 2, 1))
    metrics = WorkerMetrics()
    metrics.attach_engine(lambda: stats, lambda: None, model_name="m", max_loras=0, cache_config={})
    text = metrics.render().decode()
    labels = 'engine="0",model_name="m"'
    for line in [
        f"vllm:spec_decode_num_drafts_total{{{labels}}} 5.0",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 15.0",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 7.0",
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 4.0',
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="2"}} 1.0',
    ]:
        assert line in text
    off = WorkerMetrics()
    off.attach_engine(SchedulerStats, lambda: None, model_name="m", max_loras=0, cache_config={})
    assert "spec_decode" not in off.render().decode()  # speculation off: no series, as in vLLM


async def test_prompt_logprobs_and_a_draft_on_the_last_prefill_chunk(make_engine: EngineFactory) -> None:
    """A prompt prefilled in two chunks verifies a draft after its last chunk; its prompt logprobs, tokens and
    logprobs are those of an engine without speculation."""
    prompt = [5, 6, 7, 8, 9] * 8  # 40 tokens: two chunks of the 32-token budget
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    outs = []
    for kw in ({}, {"speculative_config": SPEC}):
        engine = await make_engine(max_loras=0, **kw)
        outs.append([o async for o in engine.generate("p", prompt, params)])
    plain, spec = outs
    assert [o.token_id for o in spec] == [o.token_id for o in plain]
    assert spec[0].prompt_logprobs is not None and plain[0].prompt_logprobs is not None
    for (a, _, ta), (b, _, tb) in zip(spec[0].prompt_logprobs, plain[0].prompt_logprobs, strict=True):
        assert abs(a - b) < 1e-3 and ta.keys() == tb.keys()
    assert engine.stats.spec_drafts > 0
