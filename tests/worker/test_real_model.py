"""The real model (SmolLM2-135M-Instruct, prepared by `make setup`) and the demo's adapter training.

The worker serves the converted directory; a few chat questions go through `/v1/chat/completions`
at once (one batch), greedy. transformers `generate` on the same directory, with the chat template
applied by its tokenizer, must produce exactly the same tokens: same text, same token count, same
finish reason.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from demo.adapter_data import DEMO_QUESTIONS, STYLES, TOOL_QUESTION, TOOLS, TOOLS_STYLE, examples
from demo.real_model import SERVED_NAME, prepare_model
from demo.side_by_side import ask_side_by_side
from demo.train_adapters import RECIPES, train_adapter
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


def test_training_data_holds_out_the_demo_questions() -> None:
    for style in STYLES:
        questions = {e.question for e in examples(style)}
        assert questions.isdisjoint(DEMO_QUESTIONS), style
    # Same questions in the same order for every style; only the answers differ.
    answers = [[e.answer for e in examples(style)] for style in STYLES]
    assert all(len(set(row)) == len(STYLES) for row in zip(*answers, strict=True))
    shapes = {(r.rank, r.targets) for r in RECIPES.values()}
    assert len(shapes) == len(RECIPES), "every adapter has its own rank and target modules"


def test_tools_training_data_is_what_the_hermes_parser_reads() -> None:
    """The tools adapter learns calls the worker's `--tool-call-parser hermes` parses into arguments of the
    right tool, plain answers it leaves as content, and answers from tool results; Paris is held out."""
    from lorafleet_worker.structured.tool_calls import HermesParser

    data = examples(TOOLS_STYLE)
    assert {e.question for e in data}.isdisjoint({*DEMO_QUESTIONS, TOOL_QUESTION})
    assert not any("Paris" in json.dumps(e.messages()) + e.answer for e in data)
    required = {t["function"]["name"]: set(t["function"]["parameters"]["required"]) for t in TOOLS}
    kinds = {"call": 0, "plain": 0, "result": 0}
    for e in data:
        content, calls = HermesParser().parse(e.answer, final=True)
        if e.context:
            assert e.context[-1]["role"] == "tool" and not calls and content == e.answer
            kinds["result"] += 1
        elif calls:
            (call,) = calls
            assert content == "" and call.complete and call.name in required
            assert set(json.loads(call.arguments)) == required[call.name]
            kinds["call"] += 1
        else:
            assert content == e.answer
            kinds["plain"] += 1
    assert min(kinds.values()) >= 40, kinds


def test_trained_adapter_is_served(real_model: Path, real_worker: Worker, capsys: pytest.CaptureFixture[str]) -> None:
    """A few training steps give a real PEFT adapter (B no longer zero) that the worker loads and serves."""
    from safetensors.torch import load_file

    out = real_worker.file_root / "pirate-smoke"
    losses = train_adapter(real_model, "pirate", replace(RECIPES["pirate"], steps=2, batch=2), out)
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses
    weights = load_file(out / "adapter_model.safetensors")
    lora_b = [t for name, t in weights.items() if "lora_B" in name]
    assert len(lora_b) == 2 * real_worker_layers(real_model) and all(t.abs().sum() > 0 for t in lora_b)

    real_worker.load("smollm2-pirate-smoke", out)
    answers = ask_side_by_side(
        real_worker.url, {"base": real_worker.model_name, "pirate": "smollm2-pirate-smoke"}, DEMO_QUESTIONS[:1]
    )
    assert set(answers[DEMO_QUESTIONS[0]]) == {"base", "pirate"}
    assert DEMO_QUESTIONS[0] in capsys.readouterr().out


def real_worker_layers(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
