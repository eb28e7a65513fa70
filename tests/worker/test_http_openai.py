"""The official `openai` Python client against a real worker: completions, chat, streaming, models, errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.worker.conftest import Worker

ADAPTER = "openai/style-adapter"


@pytest.fixture(scope="module")
def client(
    shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any, place_adapter: Any
) -> Iterator[openai.OpenAI]:
    path = place_adapter(tiny_adapter_factory(tiny_models["llama"], rank=8, seed=21), "openai-adapter")
    shared_worker.load(ADAPTER, path)
    with openai.OpenAI(base_url=f"{shared_worker.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    shared_worker.unload(ADAPTER)


def test_models_list_has_base_and_adapter(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    assert "tiny-llama" in models and ADAPTER in models
    assert (models[ADAPTER].model_extra or {}).get("parent") == "tiny-llama"


@pytest.mark.parametrize("model", ["tiny-llama", ADAPTER])
def test_completion(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt="Hello, world!", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens == 6


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": ADAPTER,
        "prompt": "The weather was",
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_and_chat_stream(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is your name?"}]
    full = client.chat.completions.create(
        model=ADAPTER, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(
        model=ADAPTER,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=ADAPTER, prompt="Numbers:", max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)


def test_unknown_model_is_a_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)
    assert "no-such-adapter" in str(info.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=1, extra_body={"guided_regex": "(?=a)b"})
    assert "guided_regex" in str(bad.value)
