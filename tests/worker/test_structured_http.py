"""Structured output and tool calls through the `openai` client, on a random tiny model and an adapter.

The model is noise, so every answer that validates does so because of the grammar. Schemas are
bounded (enums, bounded integers and strings, array lengths) so that a grammar-following answer
always fits in max_tokens.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from partial_json_parser import loads as partial_loads
from pydantic import BaseModel, Field

from tests.worker.conftest import Worker, start_worker, stop_worker

ADAPTER = "structured/adapter"


class Colour(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Palette(BaseModel):
    """enum, bounded integer, bounded string, array length: what `chat.completions.parse` users send."""

    name: str = Field(min_length=1, max_length=6)
    favourite: Colour
    count: int = Field(ge=1, le=99)
    shades: list[Colour] = Field(min_length=1, max_length=3)


UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "unit": UNIT},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 4}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES: list[Any] = [{"role": "user", "content": "Pick a palette."}]
# As `parse` sends it: no properties beyond the model's (pydantic's own schema allows any more, unbounded)
PALETTE_SCHEMA = {**Palette.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def worker(tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    import shutil

    w = start_worker(
        tiny_models["llama"],
        tmp_path_factory.mktemp("structured"),
        name="tiny-llama",
        args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    )
    shutil.copytree(tiny_adapter_factory(tiny_models["llama"], rank=8, seed=5), w.file_root / "a")
    w.load(ADAPTER, w.file_root / "a")
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def client(worker: Worker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.mark.parametrize("model", ["tiny-llama", ADAPTER])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Palette, max_tokens=200, seed=3, n=2
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Palette)  # the client validated it against the model
        assert choice.message.content is not None and "\n" not in choice.message.content


def test_streamed_json_schema_validates(client: openai.OpenAI) -> None:
    schema = PALETTE_SCHEMA
    stream = client.chat.completions.create(
        model=ADAPTER,
        messages=MESSAGES,
        max_tokens=200,
        stream=True,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "palette", "schema": schema}},
    )
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    assert len([p for p in parts if p]) > 3  # really streamed
    Palette.model_validate_json("".join(parts))


def test_json_object_is_a_json_object_or_a_prefix_of_one(client: openai.OpenAI) -> None:
    """Any object is unbounded, so noise may be cut by max_tokens: then the text is a valid JSON prefix."""
    out = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=40, response_format={"type": "json_object"}, seed=1, n=4
    )
    for choice in out.choices:
        text = choice.message.content or ""
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"
            partial_loads(text)


def test_max_tokens_cuts_a_constrained_answer_with_length(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny-llama", prompt="x", max_tokens=3, extra_body={"guided_json": {"type": "string"}}, seed=2
    )
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text.startswith('"') and out.usage is not None and out.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": "[0-9]{3}-[a-c]{2}"}, lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'start: "ab" NUM\nNUM: /[0-9]/'}, lambda t: len(t) == 3 and t[:2] == "ab"),
    ],
)
def test_vllm_guided_fields_on_completions_with_logprobs_and_penalties(
    client: openai.OpenAI, extra: dict[str, Any], check: Any
) -> None:
    out = client.completions.create(
        model=ADAPTER,
        prompt="Once upon a time",
        max_tokens=30,
        n=3,
        logprobs=2,
        presence_penalty=1.0,
        extra_body={**extra, "repetition_penalty": 1.3},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) >= 1


def test_unsupported_schema_is_a_400_naming_the_path(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-llama",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        )
    message = str(err.value)
    assert "response_format.json_schema.schema" in message and "#/properties/tags" in message


def _check_weather_call(call: Any) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and args["unit"] in UNIT["enum"] and len(args) == 2
    else:
        assert call.function.name == "get_time" and len(args["zone"]) <= 4


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(client: openai.OpenAI, parallel: bool) -> None:
    out = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=300,
        seed=4,
        n=3,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            _check_weather_call(call)


@pytest.mark.parametrize("model", ["tiny-llama", ADAPTER])
def test_named_tool_choice_streamed_and_accumulated_by_the_client(client: openai.OpenAI, model: str) -> None:
    with client.chat.completions.stream(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        seed=9,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    _check_weather_call(calls[0])


def test_auto_without_a_call_answers_content_and_tool_results_go_back_through_the_template(
    client: openai.OpenAI,
) -> None:
    """A noise model writes no `<tool_call>`: auto answers its text; a conversation with a call and its
    result (role "tool") renders and answers."""
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(
        model="tiny-llama", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    plain = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, temperature=0)
    assert choice.message.content == plain.choices[0].message.content


def test_a_mixed_batch_keeps_each_request_to_its_own_constraint(worker: Worker) -> None:
    """Free and constrained requests, different grammars and the base model and an adapter, all at once."""
    schema = PALETTE_SCHEMA
    chat = "/v1/chat/completions"

    def body(model: str, **extra: Any) -> dict[str, Any]:
        return {"model": model, "messages": MESSAGES, "max_tokens": 200, "seed": 7, **extra}

    requests: list[tuple[str, dict[str, Any], Any]] = [
        (chat, body("tiny-llama"), None),
        (chat, body(ADAPTER, temperature=0), None),
        (chat, body("tiny-llama", guided_json=schema), Palette.model_validate_json),
        (chat, body(ADAPTER, guided_json=schema, n=2), Palette.model_validate_json),
        (chat, body(ADAPTER, guided_regex="[a-z]{2,5}"), lambda t: (t.isalpha() and 2 <= len(t) <= 5) or 1 / 0),
        (chat, body("tiny-llama", guided_choice=["left", "right"]), lambda t: t in ("left", "right") or 1 / 0),
        (chat, body(ADAPTER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None),
        ("/v1/completions", {"model": ADAPTER, "prompt": "The", "max_tokens": 20}, None),
    ]

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=worker.url, timeout=600) as http:
            rs = await asyncio.gather(*(http.post(path, json=b) for path, b, _ in requests))
        for r in rs:
            assert r.status_code == 200, r.text
        return [r.json() for r in rs]

    for (_, b, check), out in zip(requests, asyncio.run(run()), strict=True):
        for choice in out["choices"]:
            if check is not None:
                assert choice["finish_reason"] == "stop", choice
                check(choice["message"]["content"])
            if b.get("tool_choice") == "required":
                assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
