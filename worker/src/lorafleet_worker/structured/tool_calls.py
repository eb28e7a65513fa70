"""Tool calls: what `tool_choice` asks for, the parsers of each model format, and streamed deltas.

`required` and a named function are enforced by a grammar (as in vLLM): the model writes a JSON
array `[{"name": ..., "parameters": {...}}, ...]` or the named function's arguments, whatever it
was trained on. `auto` parses the model's own format with the parser chosen by `--tool-call-parser`:
`hermes` (Hermes, Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) or
`llama3_json` (Llama 3.x: `{"name": ..., "parameters": {...}}`, several joined by `;`).

Every parser is a pure function of the text generated so far: it returns the content that is
certain to be content and the calls seen, each with its arguments as JSON text that only grows
(partial JSON is read with partial-json-parser; incomplete strings and numbers are left out until
complete). `ToolCallStream` turns successive parses into OpenAI's `delta.tool_calls` pieces, so the
concatenated pieces equal the final arguments.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

PARSER_NAMES = ("hermes", "llama3_json")


@dataclass
class ToolCallDraft:
    """A call seen in the output: its name once complete, its arguments as stable JSON text."""

    name: str | None
    arguments: str
    complete: bool


class ToolCallParser(Protocol):
    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallDraft]]:
        """(content, calls) of the text so far; `final`: the output is complete."""


def _partial(text: str) -> Any:
    """The complete part of a JSON prefix (None when nothing is complete yet)."""
    if not text.strip():
        return None
    try:
        return partial_loads(text, Allow.ARR | Allow.OBJ)
    except Exception:  # partial-json-parser raises its own and plain errors for garbage
        return None


def _arguments_text(args: Any, complete: bool) -> str:
    """Arguments as JSON text; while incomplete, without the closing brackets still to come."""
    if args is None:
        return ""
    if isinstance(args, str):  # some models write arguments as a JSON string
        return args if complete else ""
    text = json.dumps(args, ensure_ascii=False)
    return text if complete else text.rstrip("]}")


def _draft(obj: Any, complete: bool, *, args_keys: Sequence[str]) -> ToolCallDraft | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = next((obj[k] for k in args_keys if k in obj), None)
    if complete and args is None:
        args = {}
    return ToolCallDraft(name if isinstance(name, str) else None, _arguments_text(args, complete), complete)


def _held_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional content."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallDraft]]:
        at = text.find(self.start)
        if at < 0:
            return (text if final else _held_back(text, self.start)), []
        calls: list[ToolCallDraft] = []
        for block in text[at + len(self.start) :].split(self.start):
            body, closed, _ = block.partition(self.end)
            complete = bool(closed) or final
            if complete:
                try:
                    obj = json.loads(body)
                except json.JSONDecodeError:
                    if final:  # not a tool call after all (vLLM answers such text as content)
                        return text, []
                    continue
            else:
                obj = _partial(body)
            draft = _draft(obj, complete, args_keys=("arguments", "parameters"))
            if draft is not None:
                calls.append(draft)
        return text[:at], calls


class Llama3JsonParser:
    """Llama 3's JSON calls: `{"name": ..., "parameters": {...}}`, several joined by `;`, optionally
    after `<|python_tag|>`; output that does not start with `{` is content."""

    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallDraft]]:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :].lstrip()
        elif self.tag.startswith(body) and body and not final:
            return "", []
        if not body:
            return ("" if not final else text), []
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls: list[ToolCallDraft] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
                complete = True
            except json.JSONDecodeError:
                if final:
                    return (text, []) if not calls else ("", calls)
                obj, end, complete = _partial(body[pos:]), len(body), False
            draft = _draft(obj, complete, args_keys=("parameters", "arguments"))
            if draft is not None:
                calls.append(draft)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return "", calls


class RequiredParser:
    """`tool_choice: "required"`: the grammar's JSON array of `{"name", "parameters"}` objects."""

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallDraft]]:
        try:
            items = json.loads(text)
            closed = True
        except json.JSONDecodeError:
            items, closed = _partial(text), False
        if not isinstance(items, list):
            return "", []
        calls = []
        for i, item in enumerate(items):
            complete = closed or i < len(items) - 1
            draft = _draft(item, complete, args_keys=("parameters",))
            if draft is not None:
                calls.append(draft)
        return "", calls


class NamedParser:
    """A named `tool_choice`: the whole output is the arguments of that function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallDraft]]:
        return "", [ToolCallDraft(self.name, text, final)]


def make_parser(name: str) -> ToolCallParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_objects(drafts: Sequence[ToolCallDraft]) -> list[dict[str, Any]]:
    """The `message.tool_calls` of a complete response."""
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
        for d in drafts
        if d.name is not None
    ]


@dataclass
class ToolCallStream:
    """Streamed content and `delta.tool_calls` pieces from the growing output of one choice."""

    parser: ToolCallParser
    text: str = ""
    sent_content: str = ""
    sent_names: list[str] = field(default_factory=list)
    sent_args: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.sent_names)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Add output text; returns the new content and the tool-call pieces (one per call index)."""
        self.text += delta
        content, drafts = self.parser.parse(self.text, final)
        new_content = ""
        if content.startswith(self.sent_content) and not self.sent_names:
            new_content, self.sent_content = content[len(self.sent_content) :], content
        pieces: list[dict[str, Any]] = []
        for i, draft in enumerate(drafts):
            if draft.name is None:
                break
            piece: dict[str, Any] = {"index": i}
            if i == len(self.sent_names):
                self.sent_names.append(draft.name)
                self.sent_args.append("")
                piece.update(id=new_call_id(), type="function", function={"name": draft.name, "arguments": ""})
            sent = self.sent_args[i]
            if len(draft.arguments) > len(sent) and draft.arguments.startswith(sent):
                piece.setdefault("function", {})["arguments"] = draft.arguments[len(sent) :]
                self.sent_args[i] = draft.arguments
            if len(piece) > 1:
                pieces.append(piece)
        return new_content, pieces
