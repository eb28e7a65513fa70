"""Request validation in one place: an OpenAI body into prompts, sampling params, a grammar and a tool plan.

Pydantic (protocol.py) checks each field's type and range; this module checks what spans fields
or needs the model (context length, vocabulary, which constraint, tool_choice against tools and the
server's flags) and raises `APIError(400)` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lorafleet_worker.api.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatTool,
    NamedToolChoice,
    _SamplingBody,
)
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker.structured.grammar import (
    Choice,
    Constraint,
    Grammar,
    GrammarError,
    JsonObject,
    JsonSchema,
    Regex,
    ToolCalls,
)
from lorafleet_worker.structured.tool_calls import (
    NamedParser,
    RequiredParser,
    ToolCallParser,
    make_parser,
)


def prompt_ids(encode: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    """One completion prompt (text, encoded with `encode`, or token ids) as token ids."""
    if isinstance(prompt, str):
        ids = encode(prompt)
    else:
        ids = list(prompt)
        if any(not 0 <= t < vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def sampling_params(
    body: _SamplingBody,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's parameters for one prompt of `body`."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(
            400, f"the prompt has {prompt_len} tokens; this model's context is {max_model_len}", param="prompt"
        )
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length {max_model_len}",
            param="max_tokens",
        )
    max_tokens = max_tokens if max_tokens is not None else min(room, body.default_max_tokens or room)
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
        min_p=body.min_p,
        seed=body.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logit_bias=body.token_bias(vocab_size),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
    )
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e)) from e
    return params


def structured_output(body: _SamplingBody) -> Constraint | None:
    """The grammar `body` asks for: response_format, structured_outputs or a guided_* field (at most one)."""
    specs: list[Constraint] = []
    try:
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            specs.append(JsonObject("response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(
                    400, "response_format.json_schema is required with type json_schema", param="response_format"
                )
            specs.append(JsonSchema.of(rf.json_schema.schema_, "response_format.json_schema.schema"))
        so = body.structured_outputs
        if so is not None:
            given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k)]
            if len(given) != 1:
                raise APIError(
                    400,
                    "structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
                    param="structured_outputs",
                )
            kind = given[0]
            param = f"structured_outputs.{kind.rstrip('_')}"
            if kind == "json_":
                specs.append(JsonSchema.of(so.json_, param))
            elif kind == "choice":
                specs.append(Choice.of(so.choice or [], param))
            elif kind == "json_object":
                specs.append(JsonObject(param))
            else:
                specs.append((Regex if kind == "regex" else Grammar)(getattr(so, kind), param))
        if body.guided_json is not None:
            specs.append(JsonSchema.of(body.guided_json, "guided_json"))
        if body.guided_regex is not None:
            specs.append(Regex(body.guided_regex, "guided_regex"))
        if body.guided_choice is not None:
            specs.append(Choice.of(body.guided_choice, "guided_choice"))
        if body.guided_grammar is not None:
            specs.append(Grammar(body.guided_grammar, "guided_grammar"))
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from e
    if len(specs) > 1:
        fields = ", ".join(s.param for s in specs)
        raise APIError(400, f"at most one structured-output constraint per request, got {fields}", param=specs[1].param)
    spec = specs[0] if specs else None
    if spec is not None and body.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with structured output", param="ignore_eos")
    return spec


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolPlan:
    """How a chat request uses its tools: the template gets `tools`; `parser` reads calls from the output;
    `grammar` (required / named) makes the model write them."""

    mode: ToolMode
    tools: list[dict[str, Any]]
    parser: ToolCallParser | None = None
    grammar: Constraint | None = None
    parallel: bool = True  # False: only the first call is returned


def _function_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """vLLM's grammar for `tool_choice: "required"`: an array of calls to the given functions."""
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _function_schema(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": item}


def tool_plan(body: ChatCompletionRequest, *, auto_tool_choice: bool, parser_name: str | None) -> ToolPlan:
    """Check `tools` / `tool_choice` / `parallel_tool_calls` and say how the request uses them."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan("none", dumped)
    if body.structured_outputs or body.guided_json or body.guided_regex or body.guided_choice or body.guided_grammar:
        raise APIError(400, "tools cannot be combined with a structured-output constraint", param="tool_choice")
    rf = body.response_format
    if rf is not None and rf.type != "text":
        raise APIError(400, "tools cannot be combined with response_format", param="response_format")
    if choice == "auto":
        if not (auto_tool_choice and parser_name):
            raise APIError(
                400,
                'tool_choice "auto" needs a worker started with --enable-auto-tool-choice and --tool-call-parser; '
                'use "required", a named function or "none"',
                param="tool_choice",
            )
        return ToolPlan("auto", dumped, make_parser(parser_name), parallel=body.parallel_tool_calls)
    if choice == "required":
        schema = _required_schema(tools, body.parallel_tool_calls)
        return ToolPlan("required", dumped, RequiredParser(), ToolCalls.of(schema, "tools"))
    assert isinstance(choice, NamedToolChoice)
    named = next((t for t in tools if t.function.name == choice.function.name), None)
    if named is None:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
    i = tools.index(named)
    spec = ToolCalls.of(_function_schema(named), f"tools[{i}].function.parameters")
    return ToolPlan("named", dumped, NamedParser(named.function.name), spec)
