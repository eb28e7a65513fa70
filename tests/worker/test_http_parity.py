"""Parity with transformers + PEFT through the real HTTP API.

For llama, qwen2 and qwen3: four adapters (ranks 4..64 on all seven projections, one rsLoRA, one with
rank_pattern / alpha_pattern) and the base model, one burst of concurrent requests (one mixed batch),
the same greedy tokens and fp32 logprobs within 1e-3 as PEFT on the same weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.worker.conftest import Worker, start_worker, stop_worker

ARCHS = ("llama", "qwen2", "qwen3")
MAX_TOKENS = 8
TOLERANCE = 1e-3
ADAPTERS: dict[str, dict[str, Any]] = {
    "p/r4": {"rank": 4, "seed": 1},
    "p/r16-rslora": {"rank": 16, "alpha": 24, "rslora": True, "seed": 2},
    "p/r8-pattern": {
        "rank": 8,
        "rank_pattern": {"q_proj": 4, "down_proj": 12},
        "alpha_pattern": {"o_proj": 3.0},
        "seed": 3,
    },
    "p/r64": {"rank": 64, "alpha": 32, "seed": 4},
}
PROMPTS = ["Once upon a time there was", "Hello, world! How are you today? I am fine", "def add(a, b):"]


@pytest.fixture(scope="module", params=ARCHS)
def parity_setup(
    request: pytest.FixtureRequest,
    tiny_models: Any,
    tiny_adapter_factory: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Worker, dict[str, Path]]]:
    """A fresh worker per architecture (so its step counters only see this test) with the four adapters."""
    arch = request.param
    adapters = {name: tiny_adapter_factory(tiny_models[arch], **kw) for name, kw in ADAPTERS.items()}
    root = Path(next(iter(adapters.values()))).parent
    worker = start_worker(
        tiny_models[arch],
        tmp_path_factory.mktemp(f"parity_{arch}"),
        name=f"tiny-{arch}",
        file_root=root,
        args=["--max-loras", str(len(ADAPTERS)), "--max-num-seqs", "32", "--dtype", "float32"],
    )
    try:
        for name, path in adapters.items():
            worker.load(name, path)
        yield worker, adapters
    finally:
        stop_worker(worker)


@torch.no_grad()
def _peft_reference(
    model_dir: Path, adapters: dict[str, Path], requests: list[tuple[str | None, list[int]]]
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs from transformers + PEFT, one adapter at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)

    def greedy(prompt: list[int]) -> tuple[list[int], list[float]]:
        ids = list(prompt)
        tokens, logprobs = [], []
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(lp))
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
        return tokens, logprobs

    results = []
    for adapter, prompt in requests:
        if adapter is None:
            with model.disable_adapter():
                results.append(greedy(prompt))
        else:
            model.set_adapter(adapter)
            results.append(greedy(prompt))
    return results


async def _burst(worker: Worker, requests: list[tuple[str | None, list[int]]]) -> list[dict[str, Any]]:
    """All requests at once (one mixed batch of adapters and the base model)."""
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(adapter: str | None, prompt: list[int]) -> dict[str, Any]:
            body = {
                "model": adapter or worker.model_name,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            r = await client.post(f"{worker.url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        return await asyncio.gather(*(one(a, p) for a, p in requests))


def test_mixed_batch_matches_peft(parity_setup: tuple[Worker, dict[str, Path]]) -> None:
    from transformers import AutoTokenizer

    worker, adapters = parity_setup
    tokenizer = AutoTokenizer.from_pretrained(worker.model_dir)
    requests: list[tuple[str | None, list[int]]] = [
        (adapter, tokenizer.encode(prompt)) for adapter in [None, *adapters] for prompt in PROMPTS[:2]
    ]
    requests.append((None, tokenizer.encode(PROMPTS[2])))
    responses = asyncio.run(_burst(worker, requests))
    expected = _peft_reference(worker.model_dir, adapters, requests)

    worst = 0.0
    for (adapter, prompt), out, (tokens, logprobs) in zip(requests, responses, expected, strict=True):
        lp = out["choices"][0]["logprobs"]
        got_tokens = [int(t.split(":")[1]) for t in lp["tokens"]]
        where = f"adapter={adapter} prompt={prompt[:6]}..."
        assert got_tokens == tokens, f"{where}: greedy tokens differ from PEFT"
        diffs = [abs(a - b) for a, b in zip(lp["token_logprobs"], logprobs, strict=True)]
        worst = max(worst, *diffs)
        assert max(diffs) < TOLERANCE, f"{where}: logprobs differ by {max(diffs):.2e}"
    print(f"{worker.model_name}: {len(requests)} requests, max |logprob diff| = {worst:.2e}")

    metrics = worker.metrics()
    assert metrics["lorafleet_max_adapters_in_step"] == len(ADAPTERS), "the adapters never shared a step"
    assert metrics["lorafleet_engine_max_seqs_in_step"] > len(ADAPTERS)
