"""vLLM's API beyond completions and chat: /tokenize, /detokenize, /version, --lora-modules, reasoning parsers,
prompt_logprobs, and OpenAI's Responses API through the real `openai` client."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from lorafleet_worker.api.reasoning import ReasoningParser
from lorafleet_worker.api.responses import ResponseEvents, ResponseObject, ResponsesRequest

from tests.worker.conftest import Worker, start_worker, stop_worker

MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story."}]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


# --- reasoning parsers on strings and streamed pieces -----------------------------------------------------

SPLITS = [
    # (parser, thinking, output, (reasoning, content))
    ("deepseek_r1", True, "plan it</think>\n\nThe answer.", ("plan it", "\n\nThe answer.")),
    ("deepseek_r1", True, "<think>plan it</think>The answer.", ("plan it", "The answer.")),
    ("deepseek_r1", True, "still thinking <thi", ("still thinking <thi", None)),  # no end: all reasoning
    ("deepseek_r1", True, "</think>", ("", None)),
    ("deepseek_r1", True, "a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),  # after the end: content
    ("qwen3", True, "<think>\nhm\n</think>\n\nYes.", ("\nhm\n", "\n\nYes.")),
    ("qwen3", False, "<think>x</think>Yes.", (None, "<think>x</think>Yes.")),  # enable_thinking false
]


@pytest.mark.parametrize(("name", "thinking", "text", "expected"), SPLITS)
def test_reasoning_split_and_streamed_pieces_agree(
    name: str, thinking: bool, text: str, expected: tuple[str | None, str | None]
) -> None:
    parser = ReasoningParser(name)
    assert parser.split(text, thinking) == expected
    for size in (1, 2, 3, 5):  # every way of cutting the text into pieces of this size
        stream = parser.stream(thinking)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        fed = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        reasoning, content = "".join(r for r, _ in fed), "".join(c for _, c in fed)
        assert (reasoning if thinking else None, content or None) == expected, size


def test_reasoning_parser_thinking_follows_enable_thinking() -> None:
    assert ReasoningParser("qwen3").thinking(None) and ReasoningParser("qwen3").thinking({"enable_thinking": True})
    assert not ReasoningParser("qwen3").thinking({"enable_thinking": False})
    assert ReasoningParser("deepseek_r1").thinking({"enable_thinking": False})  # vLLM's deepseek_r1 ignores it
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("granite")


def test_response_events_accumulate_like_the_openai_client() -> None:
    """Chat deltas -> Responses events, checked by the openai client's own stream accumulator."""
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    body = ResponsesRequest(model="m", input="hi", tools=[WEATHER])  # type: ignore[list-item]
    events = ResponseEvents(ResponseObject(body))
    raw = events.start()
    raw += events.feed({"reasoning": "think"})
    raw += events.feed({"content": "Hel"})
    raw += events.feed({"content": "lo"})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    raw += events.feed({"tool_calls": [call]})
    raw += events.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})
    raw += events.feed({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]})
    raw += events.finish("tool_calls", {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)  # type: ignore[list-item]
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for e in raw:
        state.handle_event(adapter.validate_python(e))
    final = state._completed_response
    assert final is not None and final.id.startswith("resp_") and final.status == "completed"
    assert final.output_text == "Hello"
    kinds = [item.type for item in final.output]
    assert kinds == ["reasoning", "message", "function_call"]
    fc = final.output[2]
    assert fc.type == "function_call" and fc.call_id == "call_1" and json.loads(fc.arguments) == {"city": "Oslo"}
    assert final.usage is not None and final.usage.total_tokens == 8


def test_lora_modules_paths_become_source_uris(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """--lora-modules: a relative path is a local directory under the working directory, a URI stays as it is."""
    from lorafleet_worker.service import lora_module_uri

    monkeypatch.chdir(tmp_path)
    assert lora_module_uri("adapters/a") == f"file://{tmp_path}/adapters/a"
    assert lora_module_uri(str(tmp_path / "b")) == f"file://{tmp_path}/b"
    assert lora_module_uri("s3://bucket/b") == "s3://bucket/b"


# --- a worker with --reasoning-parser and --lora-modules -------------------------------------------------


@pytest.fixture(scope="module")
def worker(tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    import shutil

    workdir = tmp_path_factory.mktemp("vllm_api")
    root = workdir / "adapters"
    shutil.copytree(tiny_adapter_factory(tiny_models["llama"], rank=8, seed=31), root / "pre")
    module = json.dumps({"name": "pre/json", "path": str(root / "pre"), "base_model_name": "tiny-llama"})
    w = start_worker(
        tiny_models["llama"],
        workdir,
        name="tiny-llama",
        args=["--reasoning-parser", "qwen3", "--lora-modules", f"pre={root / 'pre'}", module],
    )
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def client(worker: Worker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_lora_modules_are_loaded_at_start(worker: Worker, client: openai.OpenAI) -> None:
    assert set(worker.loras()) == {"pre", "pre/json"}  # already when /ready first answered (start_worker waits)
    models = {m.id: m for m in client.models.list()}
    assert (models["pre"].model_extra or {}).get("parent") == "tiny-llama"
    kw: dict[str, Any] = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(model="pre", **kw).choices[0].text
    b = client.completions.create(model="pre/json", **kw).choices[0].text
    base = client.completions.create(model="tiny-llama", **kw).choices[0].text
    assert a == b and a != base  # the same adapter under both names, and it changes the output


def test_version(worker: Worker) -> None:
    from importlib.metadata import version

    r = httpx.get(f"{worker.url}/version", timeout=30)
    assert r.status_code == 200 and r.json() == {"version": version("lorafleet-worker")}


def test_tokenize_and_detokenize_as_transformers(worker: Worker, tiny_models: Any) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_models["llama"])
    text = "The quick brown fox."

    def tokenize(**body: Any) -> dict[str, Any]:
        r = httpx.post(f"{worker.url}/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    out = tokenize(prompt=text, return_token_strs=True)
    assert out["tokens"] == hf(text)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"]) and out["max_model_len"] > 0
    assert tokenize(prompt=text, model="pre")["tokens"] == out["tokens"]  # an adapter shares the tokenizer
    assert tokenize(prompt=text, add_special_tokens=False)["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    for gen in (True, False):
        chat = tokenize(messages=MESSAGES, add_generation_prompt=gen)
        assert chat["token_strs"] is None
        rendered = hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
        assert chat["tokens"] == hf(rendered, add_special_tokens=False)["input_ids"]  # as vLLM renders and encodes
    ids = out["tokens"]
    r = httpx.post(f"{worker.url}/detokenize", json={"tokens": ids}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids)}
    bad = [
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400),
        ("/detokenize", {"tokens": [10**9]}, 400),
    ]
    for path, body, status in bad:
        assert httpx.post(f"{worker.url}{path}", json=body, timeout=30).status_code == status, (path, body)


def _raw_chat_text(worker: Worker, messages: list[Any], max_tokens: int, **chat_kw: Any) -> str:
    """What the model writes for `messages` (greedy), through /v1/completions on the chat prompt's tokens."""
    r = httpx.post(f"{worker.url}/tokenize", json={"messages": messages, **chat_kw}, timeout=30)
    ids = r.json()["tokens"]
    return worker.complete("tiny-llama", ids, max_tokens=max_tokens, ignore_eos=True)["choices"][0]["text"]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_reasoning_content_through_the_openai_client(
    worker: Worker, client: openai.OpenAI, thinking: bool
) -> None:
    """Whatever the model writes, reasoning + content are the parser's split of it, streamed or not."""
    template_kw = {"enable_thinking": thinking}
    raw = _raw_chat_text(worker, MESSAGES, 12, chat_template_kwargs=template_kw)
    expected = ReasoningParser("qwen3").split(raw, thinking)
    extra = {"ignore_eos": True, "chat_template_kwargs": template_kw}
    kw: dict[str, Any] = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    message = client.chat.completions.create(**kw, extra_body=extra).choices[0].message
    extras = message.model_extra or {}
    assert (extras.get("reasoning_content"), message.content) == expected
    assert extras.get("reasoning") == extras.get("reasoning_content")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body=extra):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning if thinking else None, content or None) == expected
    hidden = client.chat.completions.create(**kw, extra_body={**extra, "include_reasoning": False}).choices[0]
    assert (hidden.message.model_extra or {}).get("reasoning_content") is None
    assert hidden.message.content == expected[1]


def test_responses_carry_the_reasoning_as_a_reasoning_item(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 8, "temperature": 0}
    chat = client.chat.completions.create(messages=MESSAGES, **kw).choices[0].message
    thought = (chat.model_extra or {}).get("reasoning_content")
    out = client.responses.create(
        model="tiny-llama", instructions="Be brief.", input="Tell a story.", max_output_tokens=8, temperature=0
    )
    reasoning = [item for item in out.output if item.type == "reasoning"]
    assert [c.text for item in reasoning for c in item.content or []] == ([thought] if thought else [])
    assert out.output_text == (chat.content or "")


# --- prompt_logprobs ----------------------------------------------------------------------------------------


def test_prompt_logprobs_over_http(worker: Worker) -> None:
    ids = httpx.post(f"{worker.url}/tokenize", json={"prompt": "Once upon a time"}, timeout=30).json()["tokens"]
    choice = worker.complete("tiny-llama", ids, max_tokens=1, prompt_logprobs=2)["choices"][0]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for token_id, entry in zip(ids[1:], scores[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        ranks = {i: v["rank"] for i, v in entry.items()}
        if len(entry) == 2:  # the prompt token is one of the top 2
            assert sorted(ranks.values()) == [1, 2]
        else:  # ranked over the whole vocabulary, below the top 2 (not None as before)
            assert sorted(r for i, r in ranks.items() if i != str(token_id)) == [1, 2]
            assert isinstance(ranks[str(token_id)], int) and ranks[str(token_id)] >= 3
        by_rank = sorted((v["rank"], -v["logprob"]) for v in entry.values())
        assert [lp for _, lp in by_rank] == sorted(lp for _, lp in by_rank)
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())
    # echo with logprobs scores the prompt with the same numbers (vLLM)
    echo = worker.complete("tiny-llama", ids, max_tokens=1, echo=True, logprobs=1)["choices"][0]
    token_logprobs = echo["logprobs"]["token_logprobs"][: len(ids)]
    assert token_logprobs[0] is None
    for token_id, lp, entry in zip(ids[1:], token_logprobs[1:], scores[1:], strict=True):
        assert math.isclose(lp, entry[str(token_id)]["logprob"], abs_tol=1e-4)
    assert worker.complete("tiny-llama", ids, max_tokens=1)["choices"][0]["prompt_logprobs"] is None
    body = {"model": "tiny-llama", "prompt": ids, "prompt_logprobs": 1, "stream": True}
    assert httpx.post(f"{worker.url}/v1/completions", json=body, timeout=30).status_code == 400


# --- the Responses API ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_client(shared_worker: Worker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{shared_worker.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_responses_create_and_stream_answer_as_chat(shared_client: openai.OpenAI) -> None:
    chat = shared_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=10, temperature=0)
    kw: dict[str, Any] = {
        "model": "tiny-llama",
        "instructions": "Be brief.",
        "input": "Tell a story.",
        "max_output_tokens": 10,
        "temperature": 0,
        "top_p": 1.0,
    }
    out = shared_client.responses.create(**kw)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "tiny-llama"
    assert out.output_text == chat.choices[0].message.content
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    finished = chat.choices[0].finish_reason
    assert out.status == ("incomplete" if finished == "length" else "completed")
    assert out.usage is not None and chat.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert out.usage.total_tokens == chat.usage.total_tokens
    # as a list of messages, streamed: the same text, events in the order the client expects
    with shared_client.responses.stream(**{**kw, "input": [MESSAGES[1]]}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == out.output_text
    assert final.id != out.id and final.status == out.status


def test_responses_function_tools_and_previous_response_id(shared_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny-llama", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 60}
    out = shared_client.responses.create(input="Weather?", temperature=0, **kw)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and all(
        c.name == "get_weather" and json.loads(c.arguments)["city"] in ("Paris", "Oslo") for c in calls
    )
    with shared_client.responses.stream(input="Weather?", temperature=0, **kw) as stream:
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    # the call's output goes back as a follow-up of the stored response: the history is in the prompt
    follow = shared_client.responses.create(
        model="tiny-llama",
        previous_response_id=out.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=4,
    )
    assert follow.previous_response_id == out.id
    assert follow.usage is not None and out.usage is not None
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].call_id,
                    "type": "function",
                    "function": calls[0].model_dump(include={"name", "arguments"}),
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
    ]
    url = str(shared_client.base_url).removesuffix("/v1/")
    prompt = httpx.post(f"{url}/tokenize", json={"messages": conversation}, timeout=30).json()
    assert follow.usage.input_tokens == prompt["count"] > out.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        shared_client.responses.create(model="tiny-llama", previous_response_id="resp_nope", input="x")
    with pytest.raises(openai.BadRequestError):
        shared_client.responses.create(model="tiny-llama", input="x", extra_body={"no_such_field": 1})
