"""The real model (SmolLM2-135M-Instruct, prepared by `make setup`): the worker's chat answers match transformers.

The worker serves the converted directory; a few chat questions go through `/v1/chat/completions`
at once (one batch), greedy. transformers `generate` on the same directory, with the chat template
applied by its tokenizer, must produce exactly the same tokens: same text, same token count, same
finish reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from demo.real_model import SERVED_NAME, prepare_model
from tests.worker.conftest import Worker, start_worker, stop_worker

MAX_TOKENS = 40
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "How many legs does a spider have?"},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]


@pytest.fixture(scope="module")
def real_model() -> Path:
    """The converted model (prepared here if `make setup` has not done it on this machine)."""
    return prepare_model()


@pytest.fixture(scope="module")
def real_worker(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    worker = start_worker(real_model, tmp_path_factory.mktemp("real_model"), name=SERVED_NAME)
    yield worker
    stop_worker(worker)


async def _chat_all(worker: Worker) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(messages: list[dict[str, str]]) -> dict[str, Any]:
            body = {"model": worker.model_name, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = await client.post(f"{worker.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        return await asyncio.gather(*(one(m) for m in CONVERSATIONS))


@torch.no_grad()
def _transformers_answers(model_dir: Path) -> list[tuple[list[int], str]]:
    """Greedy new tokens (end-of-sequence included when reached) from `generate`, one conversation at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    auto: Any = AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for messages in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        generated = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        new = generated[0, ids["input_ids"].shape[1] :].tolist()
        out.append((new, tokenizer.decode(new, skip_special_tokens=True)))
    return out


def test_chat_answers_match_transformers(real_model: Path, real_worker: Worker) -> None:
    responses = asyncio.run(_chat_all(real_worker))
    expected = _transformers_answers(real_model)
    eos = 2  # <|im_end|>
    for messages, response, (tokens, text) in zip(CONVERSATIONS, responses, expected, strict=True):
        choice = response["choices"][0]
        question = messages[-1]["content"]
        assert choice["message"]["content"] == text, f"{question!r}: the worker's answer differs from transformers'"
        assert response["usage"]["completion_tokens"] == len(tokens), f"{question!r}: token count differs"
        assert choice["finish_reason"] == ("stop" if tokens[-1] == eos else "length"), question
    # The model is real: it knows the capital of France (a random model would not).
    assert "Paris" in responses[0]["choices"][0]["message"]["content"]
