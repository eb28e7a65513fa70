"""Prompt logprobs (echo scoring) in the engine: across prefill chunks, with max_tokens=0, after preemption."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.sample.params import SamplingParams, TokenOutput

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def hf_logprobs(tiny_models: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()

    @torch.no_grad()
    def score(ids: list[int]) -> torch.Tensor:
        """log P(ids[i] | ids[:i]) for i >= 1, and the full log-softmax rows that predict them."""
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)

    return score


async def _outputs(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list[TokenOutput]:
    stream: AsyncIterator[TokenOutput] = engine.generate(rid, prompt, params)
    async with asyncio.timeout(120):
        return [out async for out in stream]


def _check(first: TokenOutput, prompt: list[int], rows: torch.Tensor, k: int) -> None:
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
    for i, (lp, rank, top) in enumerate(first.prompt_logprobs):
        want = float(rows[i, prompt[i + 1]])
        assert lp == pytest.approx(want, abs=TOLERANCE)
        # vLLM's rank: the tokens at least as likely, itself included (bounds allow for near ties)
        assert int((rows[i] > want + TOLERANCE).sum()) + 1 <= rank <= int((rows[i] >= want - TOLERANCE).sum())
        values, ids = rows[i].topk(k)
        assert list(top) == ids.tolist() and list(top.values()) == pytest.approx(values.tolist(), abs=TOLERANCE)


async def test_prompt_logprobs_across_chunks_and_with_max_tokens_zero(tiny_models: Any, hf_logprobs: Any) -> None:
    engine = Engine(tiny_models["llama"], max_loras=0, block_size=4, max_model_len=128, max_num_batched_tokens=8)
    await engine.start()
    try:
        scored = [int(x) for x in torch.arange(20, 50)]  # 30 tokens: four prefill chunks of at most 8
        generating = [int(x) for x in torch.arange(60, 85)]
        only, gen = await asyncio.gather(
            _outputs(engine, "score", scored, SamplingParams(max_tokens=0, prompt_logprobs=2)),
            _outputs(engine, "gen", generating, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)),
        )
        assert [(o.token_id, o.finish_reason) for o in only] == [(-1, "length")]
        _check(only[0], scored, hf_logprobs(scored), 2)
        assert len(gen) == 4 and gen[0].prompt_logprobs is not None
        assert all(o.prompt_logprobs is None for o in gen[1:])  # only on the first output
        _check(gen[0], generating, hf_logprobs(generating), 0)
        # the first generated token's logprob continues the prompt's scores
        rows = hf_logprobs([*generating, gen[0].token_id])
        assert gen[0].logprob == pytest.approx(float(rows[-1, gen[0].token_id]), abs=TOLERANCE)
    finally:
        await engine.stop()


async def test_prompt_logprobs_survive_preemption(tiny_models: Any, hf_logprobs: Any) -> None:
    # as test_engine's KV exhaustion case: 20 blocks of 4 hold one and a half of these requests
    engine = Engine(
        tiny_models["llama"], max_loras=0, block_size=4, max_model_len=64, num_kv_blocks=20, max_num_batched_tokens=32
    )
    await engine.start()
    try:
        prompts = [[int(x) for x in torch.arange(30, 60) + 7 * i] for i in range(4)]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1)
        results = await asyncio.gather(*(_outputs(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
        assert engine.stats.preemptions >= 1
        for prompt, outs in zip(prompts, results, strict=True):
            _check(outs[0], prompt, hf_logprobs(prompt), 1)
    finally:
        await engine.stop()
