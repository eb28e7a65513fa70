"""OpenAI response objects: one shaper for completions, one for chat completions (with tool calls).

A shaper builds, for one request and its choices, the complete response (`response`) and the
streamed chunks (`start_chunks`, `chunk`, `usage_chunk`), as vLLM's serving_completion and
serving_chat do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lorafleet_worker.api.generation import Delta, Generation, TokenInfo, new_request_id
from lorafleet_worker.api.protocol import _SamplingBody
from lorafleet_worker.api.reasoning import ReasoningParser, ReasoningStream
from lorafleet_worker.structured.tool_calls import ToolCallParser, ToolCallStream, tool_call_objects
from lorafleet_worker.tokenizer import Tokenizer

Chunk = dict[str, Any]


@dataclass
class Choice:
    """One choice of a response: its generation and, for echo, the prompt shown before the completion."""

    index: int
    gen: Generation
    echo_text: str = ""
    echo_tokens: list[TokenInfo] = field(default_factory=list)


class _Shaper:
    """What both response kinds share: ids, usage, the envelope, token text."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(
        self,
        tokenizer: Tokenizer,
        body: _SamplingBody,
        choices: list[Choice],
        *,
        want_logprobs: bool,
        token_ids_as_text: bool = False,
    ) -> None:
        self.choices = choices
        self.model = body.model
        self.n = body.n
        self.want_logprobs = want_logprobs
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        self.id = new_request_id(self.id_prefix)
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._token_ids_as_text = token_ids_as_text

    def token_str(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._token_ids_as_text else self._tokenizer.token_text(token_id)

    def usage(self) -> dict[str, int]:
        """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
        p = sum(c.gen.prompt_tokens for c in self.choices if c.index % self.n == 0)
        g = sum(c.gen.completion_tokens for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> Chunk:
        kind = self.chunk_object_name if chunk else self.object_name
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def stream_chunk(self, choice: dict[str, Any]) -> Chunk:
        out = self.envelope([choice], chunk=True)
        if self.continuous_usage:
            out["usage"] = self.usage()
        return out

    def usage_chunk(self) -> Chunk:
        return {**self.envelope([], chunk=True), "usage": self.usage()}

    def start_chunks(self) -> list[Chunk]:
        """Chunks sent before any delta."""
        return []

    def response(self, results: list[Delta]) -> Chunk:
        raise NotImplementedError

    def chunk(self, c: Choice, d: Delta, *, first: bool) -> Chunk:
        raise NotImplementedError


class CompletionShaper(_Shaper):
    """Completions; with `prompt_logprobs` (k), each choice of the complete response carries vLLM's
    `prompt_logprobs`: None for the first prompt token, then {token id: {"logprob", "rank", "decoded_token"}}
    for the prompt token and the k most likely there (the prompt token's rank is over the whole vocabulary)."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self,
        tokenizer: Tokenizer,
        body: _SamplingBody,
        choices: list[Choice],
        *,
        want_logprobs: bool,
        token_ids_as_text: bool = False,
        prompt_logprobs: int | None = None,
    ) -> None:
        super().__init__(tokenizer, body, choices, want_logprobs=want_logprobs, token_ids_as_text=token_ids_as_text)
        self._prompt_top = prompt_logprobs

    def prompt_logprobs(self, c: Choice) -> list[dict[str, Any] | None] | None:
        scores = c.gen.prompt_logprobs
        if self._prompt_top is None or scores is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for token_id, scored in zip(c.gen.prompt_ids[1:], scores, strict=True):
            best = list(scored.top.items())[: self._prompt_top]
            ranks = {i: r for r, (i, _) in enumerate(best, 1)}
            ranks[token_id] = scored.rank
            entries = {token_id: scored.logprob, **dict(best)}
            out.append(
                {
                    str(i): {"logprob": v, "rank": ranks.get(i), "decoded_token": self.token_str(i)}
                    for i, v in entries.items()
                }
            )
        return out

    def logprobs(self, tokens: list[TokenInfo], offset: int = 0) -> dict[str, Any]:
        return {
            "tokens": [self.token_str(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                None if t.top_logprobs is None else {self.token_str(i): lp for i, lp in t.top_logprobs.items()}
                for t in tokens
            ],
            "text_offset": [t.text_offset + offset for t in tokens],
        }

    def _choice(self, c: Choice, d: Delta, *, first: bool) -> dict[str, Any]:
        """The choice object of one delta; the first delta carries the echoed prompt."""
        text, tokens = d.text, d.tokens
        logprobs = self.logprobs(tokens, len(c.echo_text)) if self.want_logprobs else None
        if first and c.echo_text:
            text = c.echo_text + text
            if logprobs is not None:
                echo = self.logprobs(c.echo_tokens)
                logprobs = {k: echo[k] + logprobs[k] for k in echo}
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}

    def response(self, results: list[Delta]) -> Chunk:
        choices = [
            {**self._choice(c, d, first=True), "prompt_logprobs": self.prompt_logprobs(c)}
            for c, d in zip(self.choices, results, strict=True)
        ]
        return {**self.envelope(choices, chunk=False), "usage": self.usage()}

    def chunk(self, c: Choice, d: Delta, *, first: bool) -> Chunk:
        choice = self._choice(c, d, first=first)
        if not (d.tokens or (first and c.echo_tokens)):
            choice["logprobs"] = None
        return self.stream_chunk(choice)


class ChatShaper(_Shaper):
    """Chat completions; with a reasoning parser, the thinking becomes `reasoning` (and vLLM's former name
    `reasoning_content`), unless `include_reasoning` is off; with a tool-call parser, calls in the rest of
    the output become `tool_calls`."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(
        self,
        tokenizer: Tokenizer,
        body: _SamplingBody,
        choices: list[Choice],
        *,
        want_logprobs: bool,
        tool_parser: ToolCallParser | None = None,
        parallel_tool_calls: bool = True,
        reasoning: ReasoningParser | None = None,
        thinking: bool = True,
        include_reasoning: bool = True,
    ) -> None:
        """`thinking`: the output starts inside the thinking (`ReasoningParser.thinking`)."""
        super().__init__(tokenizer, body, choices, want_logprobs=want_logprobs)
        self._parser = tool_parser
        self._parallel = parallel_tool_calls
        self._streams = {c.index: ToolCallStream(tool_parser) for c in choices} if tool_parser else {}
        self._reasoning = reasoning
        self._thinking = thinking
        self._include_reasoning = include_reasoning
        self._thoughts: dict[int, ReasoningStream] = (
            {c.index: reasoning.stream(thinking) for c in choices} if reasoning else {}
        )

    def logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = self.token_str(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        def one(t: TokenInfo) -> dict[str, Any]:
            top = sorted((t.top_logprobs or {}).items(), key=lambda kv: -kv[1])
            return {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}

        return {"content": [one(t) for t in tokens]}

    @staticmethod
    def _finish(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    def _message(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        if self._reasoning is None:
            return self._answer(d.text, d.finish_reason)
        reasoning, text = self._reasoning.split(d.text, self._thinking)
        message, reason = self._answer(text or "", d.finish_reason)
        if text is None and "tool_calls" not in message:
            message["content"] = None
        thought = reasoning if self._include_reasoning else None
        return {**message, "reasoning": thought, "reasoning_content": thought}, reason

    def _answer(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The message of the output's answer (after any reasoning): content, or tool calls."""
        if self._parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, drafts = self._parser.parse(text, True)
        calls = tool_call_objects(drafts if self._parallel else drafts[:1])
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return message, self._finish(finish_reason, True)

    def response(self, results: list[Delta]) -> Chunk:
        choices = []
        for c, d in zip(self.choices, results, strict=True):
            message, reason = self._message(d)
            logprobs = self.logprobs(d.tokens) if self.want_logprobs else None
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {**self.envelope(choices, chunk=False), "usage": self.usage()}

    def start_chunks(self) -> list[Chunk]:
        choice = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self.envelope([{"index": c.index, **choice}], chunk=True) for c in self.choices]

    def chunk(self, c: Choice, d: Delta, *, first: bool) -> Chunk:
        delta: dict[str, Any] = {}
        reason = d.finish_reason
        text = d.text
        thoughts = self._thoughts.get(c.index)
        if thoughts is not None:
            thought, text = thoughts.feed(text, final=reason is not None)
            if thought and self._include_reasoning:
                delta["reasoning"] = delta["reasoning_content"] = thought
        stream = self._streams.get(c.index)
        if stream is None:
            if text:
                delta["content"] = text
        else:
            content, pieces = stream.feed(text, final=reason is not None)
            if not self._parallel:
                pieces = [p for p in pieces if p["index"] == 0]
            if content:
                delta["content"] = content
            if pieces:
                delta["tool_calls"] = pieces
            reason = self._finish(reason, stream.called)
        logprobs = self.logprobs(d.tokens) if self.want_logprobs and d.tokens else None
        return self.stream_chunk({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
