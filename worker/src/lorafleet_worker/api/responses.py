"""OpenAI's Responses API (`POST /v1/responses`) as a view of the chat-completions path.

A Responses request becomes a chat-completions request (`to_chat_request`: `instructions` a
system message, `input` messages and function-call items, function tools, `max_output_tokens`,
`text.format`), generated and shaped by the chat path (tool calls and reasoning parsed there).
Its chat message becomes the response's `output` items (`output_items`: a `reasoning` item, a
`message` with `output_text`, `function_call` items); streamed, `ResponseEvents` turns the chat
deltas into the Responses events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`) that the openai client's
`responses.stream` accumulates.

`previous_response_id`: stored responses (`store`, the default) are kept in this worker's memory
(`ResponseStore`, the most recent `MAX_STORED` conversations); a follow-up that names one
continues its conversation, one that names an unknown or evicted id is a 404.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import Field, ValidationError

from lorafleet_worker.api.protocol import APIError, ChatCompletionRequest, _OpenAIBody, validation_message

MAX_STORED = 1024

Item = dict[str, Any]
Message = dict[str, Any]


class FunctionTool(_OpenAIBody):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_OpenAIBody):
    type: Literal["function"]
    name: str


class ResponsesRequest(_OpenAIBody):
    """The fields of OpenAI's `responses.create` that have their effect here; any other is a 400."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    truncation: Literal["disabled"] | None = None
    # vLLM extensions, as in chat completions
    seed: int | None = None
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- request -> chat request -------------------------------------------------------------------------


def _text_parts(content: Any) -> str | list[dict[str, Any]]:
    """A Responses message's content as chat content (only text parts are supported)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "input message content must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"unsupported input content part {kind!r} (text parts only)", param="input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def input_messages(items: str | list[Item]) -> list[Message]:
    """Responses `input` (or stored `output`) as chat messages; function calls become an assistant's
    `tool_calls`, their outputs `tool` messages; reasoning items are dropped (as chat templates do)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[Message] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            if "role" not in item:
                raise APIError(400, "an input message needs a role", param="input")
            messages.append({"role": item["role"], "content": _text_parts(item.get("content", ""))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind != "reasoning":
            raise APIError(400, f"unsupported input item type {kind!r}", param="input")
    return messages


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def to_chat_request(body: ResponsesRequest, history: list[Message]) -> tuple[ChatCompletionRequest, list[Message]]:
    """The chat-completions request of `body` after the conversation `history`, and the conversation
    (without the instructions, which do not carry over to a follow-up, as OpenAI's)."""
    conversation = [*history, *input_messages(body.input)]
    messages = [{"role": "system", "content": body.instructions}, *conversation] if body.instructions else conversation
    choice = body.tool_choice
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "top_k": body.top_k,
        "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
        "chat_template_kwargs": body.chat_template_kwargs,
        "response_format": _response_format(body.text),
        "tools": [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in body.tools
        ]
        if body.tools
        else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionToolChoice)
        else choice,
    }
    try:
        request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        raise APIError(400, validation_message(e)) from e
    return request, conversation


# --- chat message -> response ------------------------------------------------------------------------


def _message_item(text: str, status: str = "completed") -> Item:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": _new_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _reasoning_item(text: str) -> Item:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": "completed"}


def _function_call_item(call_id: str, name: str, arguments: str) -> Item:
    return {
        "id": _new_id("fc"),
        "type": "function_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def output_items(message: Message) -> list[Item]:
    """A chat completion's message as Responses output items (a message item unless only calls came out)."""
    items: list[Item] = []
    if message.get("reasoning"):
        items.append(_reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(_message_item(message.get("content") or ""))
    for call in calls:
        items.append(_function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseObject:
    """The `response` object of one request: its id and settings, then its output and status."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.body = body

    def render(
        self,
        output: list[Item],
        *,
        status: str,
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """`status`: "in_progress" while streaming; at the end, "completed" unless the output hit
        `max_output_tokens` ("incomplete", as OpenAI's and vLLM's)."""
        b = self.body
        incomplete = status != "in_progress" and finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": b.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": b.tool_choice.model_dump()
            if isinstance(b.tool_choice, FunctionToolChoice)
            else (b.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "text": b.text or {"format": {"type": "text"}},
            "truncation": b.truncation or "disabled",
            "metadata": b.metadata or {},
            "store": b.store,
            "user": b.user,
            "usage": None if usage is None else _usage(usage),
        }


# --- streamed events -----------------------------------------------------------------------------------


class ResponseEvents:
    """The Responses events of one streamed response, from the chat path's `delta`s.

    Reasoning and message text each go to one open item (closed when the other kind starts); a
    function call gets its item when its name is known and its arguments as deltas; every item is
    closed (`*.done`, `response.output_item.done`) before `response.completed`.
    """

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.output: list[Item] = []  # items in output order, completed ones final
        self._seq = 0
        self._open: Item | None = None  # the reasoning or message item being written
        self._calls: dict[int, Item] = {}  # function-call items by the chat delta's call index

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response.render([], status="in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _add(self, item: Item) -> dict[str, Any]:
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))

    def _text_item(self, kind: str) -> tuple[Item, list[dict[str, Any]]]:
        """The open item of `kind` ("message" / "reasoning"), opened (and the other closed) if needed."""
        if self._open is not None and self._open["type"] == kind:
            return self._open, []
        events = self._close_open()
        if kind == "message":
            item = _message_item("", status="in_progress")
            part = item["content"][0]
            item["content"] = []
            events.append(self._add(item))
            item["content"] = [part]
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    part=dict(part),
                )
            )
        else:
            item = _reasoning_item("")
            item["status"], part = "in_progress", item["content"][0]
            item["content"] = []
            events.append(self._add(item))
            item["content"] = [part]
        self._open = item
        return item, events

    def _close_open(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        if item["type"] == "message":
            events = [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                ),
            ]
        else:
            events = [
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                )
            ]
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (`reasoning`, `content`, `tool_calls` pieces)."""
        events: list[dict[str, Any]] = []
        for key, kind, event in (
            ("reasoning", "reasoning", "response.reasoning_text.delta"),
            ("content", "message", "response.output_text.delta"),
        ):
            text = delta.get(key)
            if not text:
                continue
            item, opened = self._text_item(kind)
            events += opened
            item["content"][0]["text"] += text
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            index = self.output.index(item)
            events.append(
                self._event(event, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)
            )
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function") or {}
            call = self._calls.get(piece["index"])
            if call is None:
                events += self._close_open()
                call = _function_call_item(piece["id"], function["name"], "")
                call["status"] = "in_progress"
                self._calls[piece["index"]] = call
                events.append(self._add(call))
            if function.get("arguments"):
                call["arguments"] += function["arguments"]
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=self.output.index(call),
                        delta=function["arguments"],
                    )
                )
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, int]) -> list[dict[str, Any]]:
        """Close every item (an empty message when nothing came out) and complete the response."""
        events = self._close_open()
        if not self.output:
            _, opened = self._text_item("message")
            events += opened + self._close_open()
        for call in self._calls.values():
            index = self.output.index(call)
            call["status"] = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=call["id"],
                    output_index=index,
                    name=call["name"],
                    arguments=call["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=call))
        final = self.response.render(self.output, status="completed", finish_reason=finish_reason, usage=usage)
        events.append(self._event("response.completed", response=final))
        return events


# --- previous_response_id ----------------------------------------------------------------------------


class ResponseStore:
    """The conversations of the most recent stored responses, by response id (this worker's memory only)."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self._capacity = capacity
        self._conversations: OrderedDict[str, list[Message]] = OrderedDict()

    def history(self, response_id: str | None) -> list[Message]:
        """The conversation up to and including response `response_id` (none: empty); 404 when unknown."""
        if response_id is None:
            return []
        conversation = self._conversations.get(response_id)
        if conversation is None:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found (responses are kept in the memory of the worker "
                "that made them, the most recent ones only)",
                param="previous_response_id",
            )
        self._conversations.move_to_end(response_id)
        return [dict(m) for m in conversation]

    def put(self, response_id: str, conversation: list[Message], output: list[Item]) -> None:
        """Keep `conversation` followed by the response's `output`, evicting the oldest beyond capacity."""
        self._conversations[response_id] = [*conversation, *input_messages(output)]
        while len(self._conversations) > self._capacity:
            self._conversations.popitem(last=False)
