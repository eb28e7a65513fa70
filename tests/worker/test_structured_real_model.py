"""Structured output and tool calls on the real model (SmolLM2-135M-Instruct) and the demo's trained
adapters (demo.train_adapters), through the `openai` client; then all of them in one batch with plain
requests, whose greedy answers must be those they get alone.

`required` and a named `tool_choice` hold by grammar on any model; `tool_choice: "auto"` needs a model
that writes calls itself: the `tools` adapter, trained on the worker's own rendering of such requests to
answer weather and time questions with Hermes `<tool_call>` blocks and anything else in words.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from demo.adapter_data import DEMO_QUESTIONS, TOOL_QUESTION, TOOLS
from demo.real_model import SERVED_NAME, prepare_model
from demo.side_by_side import ADAPTER_MODELS, AUTO_TOOL_ARGS, CAPITAL_SCHEMA
from tests.worker.conftest import Worker, start_worker, stop_worker

JSON_ADAPTER, TOOLS_ADAPTER, FRENCH_ADAPTER = ADAPTER_MODELS["json"], ADAPTER_MODELS["tools"], ADAPTER_MODELS["french"]


class Size(enum.StrEnum):
    small = "small"
    medium = "medium"
    large = "large"


class Animal(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    size: Size
    legs: int = Field(ge=0, le=8)
    colours: list[Annotated[str, Field(max_length=12)]] = Field(min_length=1, max_length=3)


class WeatherArgs(BaseModel):
    """The parameters of the demo's `get_weather` tool (demo.adapter_data.TOOLS), as a validator."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


ANIMAL_SCHEMA = {**Animal.model_json_schema(), "additionalProperties": False}
ASK_ANIMAL = [{"role": "user", "content": "Describe a cat."}]
ASK_WEATHER: list[Any] = [{"role": "user", "content": TOOL_QUESTION}]
ASK_CAPITAL: list[Any] = [{"role": "user", "content": DEMO_QUESTIONS[0]}]  # France: held out of training
ASK_ANIMAL_ANY: Any = ASK_ANIMAL
TOOL_PARAMS: Any = TOOLS  # the openai client's TypedDicts, as plain dicts


@pytest.fixture(scope="module")
def worker(trained_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The real model with the json, tools and french adapters, `auto` tool choice on (Hermes parser)."""
    w = start_worker(
        prepare_model(),
        tmp_path_factory.mktemp("structured_real"),
        name=SERVED_NAME,
        args=["--max-model-len", "1024", *AUTO_TOOL_ARGS],
        file_root=next(iter(trained_adapters.values())).parent,
    )
    for style in ("json", "tools", "french"):
        w.load(ADAPTER_MODELS[style], trained_adapters[style])
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def client(worker: Worker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def _weather_args(call: Any) -> WeatherArgs:
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name == "get_weather", call
    return WeatherArgs.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("model", [SERVED_NAME, JSON_ADAPTER])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.parse(
        model=model, messages=ASK_ANIMAL_ANY, response_format=Animal, max_tokens=150, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Animal)


def test_streamed_json_schema_on_the_json_adapter(client: openai.OpenAI) -> None:
    """The adapter trained on `{"country", "capital"}` answers a held-out question right, streamed."""
    stream = client.chat.completions.create(
        model=JSON_ADAPTER,
        messages=ASK_CAPITAL,
        max_tokens=60,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA}},
    )
    chunks = [c for c in stream if c.choices]
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert json.loads(text) == {"country": "France", "capital": "Paris"}


@pytest.mark.parametrize("model", [SERVED_NAME, JSON_ADAPTER])
def test_json_object(client: openai.OpenAI, model: str) -> None:
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a JSON object with the name and age of a person."}],
        max_tokens=150,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("model", [SERVED_NAME, JSON_ADAPTER, TOOLS_ADAPTER])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=TOOL_PARAMS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    if isinstance(tool_choice, dict) or calls[0].function.name == "get_weather":  # type: ignore[union-attr]
        _weather_args(calls[0])
    else:  # `required` lets the model pick either tool
        assert calls[0].function.name == "get_time"  # type: ignore[union-attr]
        assert set(json.loads(calls[0].function.arguments)) == {"city"}  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ tool_choice "auto"


def _auto(client: openai.OpenAI, model: str, messages: list[Any]) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, tools=TOOL_PARAMS, tool_choice="auto", max_tokens=60, temperature=0
    ).choices[0]


def test_auto_the_tools_adapter_calls_get_weather(client: openai.OpenAI) -> None:
    choice = _auto(client, TOOLS_ADAPTER, ASK_WEATHER)
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content, "the whole answer is the call"
    (call,) = choice.message.tool_calls
    assert _weather_args(call) == WeatherArgs(city="Paris", unit="celsius")


@pytest.mark.parametrize(
    ("model", "messages"), [(TOOLS_ADAPTER, ASK_CAPITAL), (SERVED_NAME, ASK_WEATHER)], ids=["adapter", "base"]
)
def test_auto_answers_in_words_without_a_call(client: openai.OpenAI, model: str, messages: list[Any]) -> None:
    """The tools adapter on a question no tool answers; the base model, never trained for tools, on weather."""
    choice = _auto(client, model, messages)
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls, choice
    assert choice.message.content and "<tool_call>" not in choice.message.content
    if model == TOOLS_ADAPTER:
        assert choice.finish_reason == "stop" and "Paris" in choice.message.content


def test_auto_streamed_calls_accumulate_in_the_openai_client(client: openai.OpenAI) -> None:
    """`delta.tool_calls` pieces, accumulated by the client's stream helper, give the non-streamed call."""
    with client.chat.completions.stream(
        model=TOOLS_ADAPTER, messages=ASK_WEATHER, tools=TOOL_PARAMS, tool_choice="auto", max_tokens=60, temperature=0
    ) as stream:
        pieces = [
            d
            for event in stream
            if event.type == "chunk"
            for c in event.chunk.choices
            for d in c.delta.tool_calls or []
        ]
        final = stream.get_final_completion()
    assert len(pieces) > 1, "the arguments arrive in pieces"
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    (alone,) = _auto(client, TOOLS_ADAPTER, ASK_WEATHER).message.tool_calls
    assert call.function.name == alone.function.name and call.function.arguments == alone.function.arguments
    _weather_args(call)


def test_auto_a_tool_result_goes_back_and_gets_an_answer(client: openai.OpenAI) -> None:
    """The call, then its result as a `role: "tool"` message: the adapter answers from the result in words."""
    first = _auto(client, TOOLS_ADAPTER, ASK_WEATHER)
    (call,) = first.message.tool_calls
    result = {"city": "Paris", "temperature": 17, "unit": "celsius", "condition": "cloudy"}
    messages = [
        *ASK_WEATHER,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    choice = _auto(client, TOOLS_ADAPTER, messages)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    assert "17" in choice.message.content and "Paris" in choice.message.content, choice.message.content


# ------------------------------------------------------------------------------ one batch


def test_mixed_batch_leaves_plain_requests_unchanged(worker: Worker) -> None:
    """Plain greedy requests answer the same alone and inside a batch of constrained ones and auto tool
    calls (base model and adapters)."""
    chat = "/v1/chat/completions"
    plain = [
        {"model": SERVED_NAME, "messages": ASK_ANIMAL, "max_tokens": 30, "temperature": 0},
        {"model": FRENCH_ADAPTER, "messages": ASK_CAPITAL, "max_tokens": 30, "temperature": 0},
    ]
    # sampled rows (seeded) beside the greedy ones; the forced tool call is greedy: sampled at temperature 1, the
    # small model's arguments can ramble past max_tokens (CI saw 'length' once, with slightly different numerics)
    constrained = [
        {"model": SERVED_NAME, "messages": ASK_ANIMAL, "max_tokens": 150, "guided_json": ANIMAL_SCHEMA, "seed": 1},
        {"model": JSON_ADAPTER, "messages": ASK_ANIMAL, "max_tokens": 150, "guided_json": ANIMAL_SCHEMA, "seed": 2},
        {
            "model": SERVED_NAME,
            "messages": ASK_WEATHER,
            "max_tokens": 120,
            "tools": TOOLS,
            "tool_choice": "required",
            "temperature": 0,
        },
        {"model": TOOLS_ADAPTER, "messages": ASK_WEATHER, "max_tokens": 60, "tools": TOOLS, "temperature": 0},
        {"model": JSON_ADAPTER, "messages": ASK_WEATHER, "max_tokens": 10, "guided_choice": ["sunny", "rainy"]},
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
    animal_base, animal_adapter, required, auto, choice = together[len(plain) :]
    Animal.model_validate_json(animal_base["message"]["content"])
    Animal.model_validate_json(animal_adapter["message"]["content"])
    assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]
    assert auto["finish_reason"] == "tool_calls", auto  # tool_choice defaults to auto when tools are given
    WeatherArgs.model_validate_json(auto["message"]["tool_calls"][0]["function"]["arguments"])
    assert choice["message"]["content"] in ("sunny", "rainy")
