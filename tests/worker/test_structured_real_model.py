"""Structured output and tool calls on the real model (SmolLM2-135M-Instruct) and a LoRA adapter on it,
through the `openai` client; then all of them in one batch with plain requests, whose greedy answers
must be those they get alone."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from demo.real_model import SERVED_NAME, prepare_model
from tests.worker.conftest import Worker, start_worker, stop_worker

ADAPTER = "smollm2-random-r8"


class Size(enum.StrEnum):
    small = "small"
    medium = "medium"
    large = "large"


class Animal(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    size: Size
    legs: int = Field(ge=0, le=8)
    colours: list[Annotated[str, Field(max_length=12)]] = Field(min_length=1, max_length=3)


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ANIMAL_SCHEMA = {**Animal.model_json_schema(), "additionalProperties": False}
ASK_ANIMAL = [{"role": "user", "content": "Describe a cat."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def worker(tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    import shutil

    model: Path = prepare_model()
    w = start_worker(
        model, tmp_path_factory.mktemp("structured_real"), name=SERVED_NAME, args=["--max-model-len", "1024"]
    )
    shutil.copytree(tiny_adapter_factory(model, rank=8, seed=3), w.file_root / "r8")
    w.load(ADAPTER, w.file_root / "r8")
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def client(worker: Worker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


@pytest.mark.parametrize("model", [SERVED_NAME, ADAPTER])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.parse(
        model=model,
        messages=ASK_ANIMAL,
        response_format=Animal,
        max_tokens=150,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Animal)


def test_streamed_json_schema_and_json_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=ASK_ANIMAL,  # type: ignore[arg-type]
        max_tokens=150,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "animal", "schema": ANIMAL_SCHEMA},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Animal.model_validate_json(text)
    obj = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Give a JSON object with the name and age of a person."}],
        max_tokens=150,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("model", [SERVED_NAME, ADAPTER])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) >= 1
    for call in calls:
        assert call.function.name == "get_weather" and call.id.startswith("call_")  # type: ignore[union-attr]
        args = json.loads(call.function.arguments)  # type: ignore[union-attr]
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def test_mixed_batch_leaves_plain_requests_unchanged(worker: Worker) -> None:
    """Plain greedy requests answer the same alone and inside a batch of constrained ones (base, adapter)."""
    chat = "/v1/chat/completions"
    plain = [
        {"model": SERVED_NAME, "messages": ASK_ANIMAL, "max_tokens": 30, "temperature": 0},
        {"model": ADAPTER, "messages": ASK_WEATHER, "max_tokens": 30, "temperature": 0},
    ]
    constrained = [
        {"model": SERVED_NAME, "messages": ASK_ANIMAL, "max_tokens": 150, "guided_json": ANIMAL_SCHEMA},
        {"model": ADAPTER, "messages": ASK_ANIMAL, "max_tokens": 150, "guided_json": ANIMAL_SCHEMA},
        {
            "model": SERVED_NAME,
            "messages": ASK_WEATHER,
            "max_tokens": 120,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
        },
        {"model": ADAPTER, "messages": ASK_WEATHER, "max_tokens": 10, "guided_choice": ["sunny", "rainy"]},
    ]

    async def send(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=worker.url, timeout=600) as http:
            rs = await asyncio.gather(*(http.post(chat, json=b) for b in bodies))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0] for r in rs]

    alone = [asyncio.run(send([b]))[0] for b in plain]
    together = asyncio.run(send([*plain, *constrained]))
    for a, t in zip(alone, together[: len(plain)], strict=True):
        assert a["message"]["content"] == t["message"]["content"]
    animal_base, animal_adapter, weather, choice = together[len(plain) :]
    Animal.model_validate_json(animal_base["message"]["content"])
    Animal.model_validate_json(animal_adapter["message"]["content"])
    assert weather["finish_reason"] == "tool_calls" and weather["message"]["tool_calls"]
    assert choice["message"]["content"] in ("sunny", "rainy")
