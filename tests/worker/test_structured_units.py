"""Structured output and tool calls without a server: grammar compile errors and masks, tool-call parsers,
streamed tool-call deltas, request validation of the constraint fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.api.protocol import APIError, ChatCompletionRequest, CompletionRequest
from lorafleet_worker.api.validation import structured_output, tool_plan
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker.sample.sampler import SamplingState, sample
from lorafleet_worker.structured.grammar import (
    Choice,
    Grammar,
    GrammarCompiler,
    GrammarError,
    JsonObject,
    JsonSchema,
    Regex,
)
from lorafleet_worker.structured.manager import StructuredOutputManager
from lorafleet_worker.structured.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    ToolCallParser,
    ToolCallStream,
)
from lorafleet_worker.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def model_dir(tiny_models: Any) -> Path:
    path: Path = tiny_models["llama"]
    return path


@pytest.fixture(scope="module")
def compiler(model_dir: Path) -> GrammarCompiler:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    return GrammarCompiler.from_model_dir(
        model_dir, vocab_size=config["vocab_size"], eos_token_ids=eos if isinstance(eos, list) else [eos]
    )


# --- grammars ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "#/properties/tags"),
        ({"type": "object", "properties": {"x": {"type": "string", "format": "shoe-size"}}}, "#/properties/x/format"),
        ({"properties": {"a": {"properties": {"b": {"type": "string", "pattern": "(?=x)y"}}}}}, "/b/pattern"),
    ],
)
def test_an_unsupported_schema_names_the_field_and_the_schema_path(
    compiler: GrammarCompiler, schema: dict[str, Any], pointer: str
) -> None:
    with pytest.raises(GrammarError) as err:
        compiler.compile(JsonSchema.of(schema, "response_format.json_schema.schema"))
    assert err.value.param == "response_format.json_schema.schema"
    assert str(err.value).startswith("response_format.json_schema.schema: ")
    assert pointer in str(err.value)


def test_compiled_grammars_are_cached_and_each_sequence_gets_its_own_state(compiler: GrammarCompiler) -> None:
    spec = Regex("[0-9]{3}", "guided_regex")
    before = compiler.stats.compiles
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert first is second and compiler.stats.compiles == before + 1 and compiler.stats.cache_hits >= 1
    a, b = first.matcher(), first.matcher()
    for token in compiler.tokenizer.tokenize_str("123"):
        assert a.consume_token(token)
    assert a.is_stopped() and not b.is_stopped()


def test_masks_force_the_grammar_and_allow_eos_only_when_it_accepts(compiler: GrammarCompiler, model_dir: Path) -> None:
    """A random row of logits, sampled under the masks, spells a string of the grammar; a free row in the
    same batch is untouched; EOS is masked until the grammar can end."""
    tok = Tokenizer.from_dir(model_dir)
    vocab = compiler.tokenizer.vocab_size
    structured = StructuredOutputManager(model_dir, vocab_size=vocab, eos_token_ids=compiler.tokenizer.eos_tokens)
    grammar = structured.compile(Choice.of(["yes", "no way"], "guided_choice"))
    structured.add_request("constrained", grammar)
    constrained = SamplingState(SamplingParams(temperature=1.0))
    free = SamplingState(SamplingParams(temperature=0))
    eos = compiler.tokenizer.eos_tokens
    out: list[int] = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        logits = torch.randn(2, vocab, generator=gen)
        allowed = structured.start_masks(["constrained", "free"]).wait(torch.device("cpu"))
        assert allowed is not None and bool(allowed[1].all())
        if not structured.finished("constrained"):
            assert any(bool(allowed[0, e]) for e in eos) == (tok.decode(out) in ("yes", "no way"))
        picks = sample(logits, [constrained, free], allowed)
        assert picks[1].token_id == int(logits[1].argmax())
        structured.accept("constrained", picks[0].token_id)
        structured.accept("free", picks[1].token_id)  # a free request has no matcher: nothing happens
        if picks[0].token_id in eos:
            break
        out.append(picks[0].token_id)
        if structured.finished("constrained"):
            break
    assert tok.decode(out) in ("yes", "no way") and not structured.finished("free")
    structured.close()


# --- request validation ------------------------------------------------------------------------------


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, JsonObject, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            JsonSchema,
            "response_format.json_schema.schema",
        ),
        ({"guided_json": '{"type": "integer"}'}, JsonSchema, "guided_json"),
        ({"guided_regex": "[a-z]+"}, Regex, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, Choice, "guided_choice"),
        ({"guided_grammar": 'start: "x"'}, Grammar, "guided_grammar"),
        ({"structured_outputs": {"choice": ["a"]}}, Choice, "structured_outputs.choice"),
        ({"structured_outputs": {"json": {"type": "object"}}}, JsonSchema, "structured_outputs.json"),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
def test_each_constraint_field_becomes_one_grammar(fields: dict[str, Any], kind: type | None, param: str) -> None:
    spec = structured_output(_chat(**fields))
    assert (type(spec) if spec else None, spec and spec.param) == (kind, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ],
)
def test_conflicting_or_malformed_constraints_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        structured_output(_chat(**fields))
    assert err.value.status == 400 and err.value.param == param


def test_completions_take_the_same_constraint_fields() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    spec = structured_output(body)
    assert isinstance(spec, JsonObject)


@pytest.mark.parametrize(
    ("fields", "auto", "mode", "param"),
    [
        ({"tools": [WEATHER]}, True, "auto", None),
        ({"tools": [WEATHER]}, False, None, "tool_choice"),  # auto needs the server flags
        ({"tools": [WEATHER], "tool_choice": "none"}, False, "none", None),
        ({"tools": [WEATHER], "tool_choice": "required"}, False, "required", None),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            False,
            "named",
            None,
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            False,
            None,
            "tool_choice",
        ),
        ({"tool_choice": "required"}, False, None, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, False, None, "tool_choice"),
    ],
)
def test_tool_choice_modes(fields: dict[str, Any], auto: bool, mode: str | None, param: str | None) -> None:
    body = _chat(**fields)
    if param is not None:
        with pytest.raises(APIError) as err:
            tool_plan(body, auto_tool_choice=auto, parser_name="hermes" if auto else None)
        assert err.value.param == param
        return
    plan = tool_plan(body, auto_tool_choice=auto, parser_name="hermes" if auto else None)
    assert plan.mode == mode
    assert (plan.grammar is not None) == (mode in ("required", "named"))


# --- tool-call parsers and streaming -----------------------------------------------------------------

_WEATHER_ARGS = '{"city": "Paris", "days": [1, 2]}'
HERMES = (
    f'Let me check. <tool_call>\n{{"name": "get_weather", "arguments": {_WEATHER_ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA = (
    f'<|python_tag|>{{"name": "get_weather", "parameters": {_WEATHER_ARGS}}}; '
    '{"name": "get_time", "parameters": {}}'
)
REQUIRED = f'[{{"name": "get_weather", "parameters": {_WEATHER_ARGS}}}, {{"name": "get_time", "parameters": {{}}}}]'
EXPECTED = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [(HermesParser(), HERMES, "Let me check. "), (Llama3JsonParser(), LLAMA, ""), (RequiredParser(), REQUIRED, "")],
)
def test_parsers_read_complete_calls(parser: ToolCallParser, text: str, content: str) -> None:
    got_content, calls = parser.parse(text, True)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_text_without_calls_is_content(parser: ToolCallParser) -> None:
    assert parser.parse("The weather is fine.", True) == ("The weather is fine.", [])


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (HermesParser(), HERMES, "Let me check. "),
        (Llama3JsonParser(), LLAMA, ""),
        (RequiredParser(), REQUIRED, ""),
        (NamedParser("get_weather"), '{"city": "Paris", "days": [1, 2]}', ""),
    ],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_pieces_add_up_to_the_complete_calls(
    parser: ToolCallParser, text: str, content: str, step: int
) -> None:
    """Fed a few characters at a time, the content and argument pieces concatenate to the final answer,
    each call's id and name come once, and argument text never has to be taken back."""
    stream = ToolCallStream(parser)
    got_content = ""
    calls: dict[int, dict[str, str]] = {}
    for i in range(0, len(text), step):
        new, pieces = stream.feed(text[i : i + step], final=i + step >= len(text))
        got_content += new
        for p in pieces:
            call = calls.setdefault(p["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in p:
                assert not call["id"]
                call["id"], call["name"] = p["id"], p["function"]["name"]
            call["arguments"] += p.get("function", {}).get("arguments", "")
    assert got_content == content
    final = parser.parse(text, True)[1]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [(c.name, c.arguments) for c in final]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_serve_needs_a_parser_for_auto_tool_choice(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafleet_worker.cli import main

    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        main(["serve", "--model", str(model_dir), "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(model_dir), "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err
