"""Reasoning parsers (`--reasoning-parser`, vLLM's names): split a chat answer's thinking from its content.

The model thinks inside `<think>...</think>`; the text before `</think>` is the reasoning
(`message.reasoning` and `message.reasoning_content`, `delta.*` when streamed), the text after it
the content. Both parsers follow vLLM's:

- `deepseek_r1`: the output starts inside the thinking (DeepSeek-R1's template opens `<think>` in
  the prompt); an opening `<think>` the model writes itself is dropped; without `</think>` the
  whole output is reasoning.
- `qwen3`: the same while thinking is on; with `chat_template_kwargs: {"enable_thinking": false}`
  the model does not think and the whole output is content.

`ReasoningStream` does the same split on text that arrives in pieces: a piece that may be the
start of a tag is held back until the next one tells, so the streamed reasoning and content are
exactly the non-streamed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")

THINK_START = "<think>"
THINK_END = "</think>"


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class ReasoningStream:
    """The reasoning / content split of one choice's output, fed piece by piece."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that became certain with `text`; `final`: the output is complete."""
        if not self.in_reasoning:
            out, self._pending = self._pending + text, ""
            return "", out
        pending = self._pending + text
        reasoning = []
        while True:
            start, end = pending.find(THINK_START), pending.find(THINK_END)
            if end >= 0 and (start < 0 or end < start):
                reasoning.append(pending[:end])
                self.in_reasoning, self._pending = False, ""
                return "".join(reasoning), pending[end + len(THINK_END) :]
            if start < 0:
                break
            reasoning.append(pending[:start])  # an opening tag inside the thinking is dropped
            pending = pending[start + len(THINK_START) :]
        hold = 0 if final else _held(pending, (THINK_START, THINK_END))
        reasoning.append(pending[: len(pending) - hold])
        self._pending = pending[len(pending) - hold :]
        return "".join(reasoning), ""


@dataclass(frozen=True)
class ReasoningParser:
    """One of `REASONING_PARSERS`."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r} (one of {', '.join(REASONING_PARSERS)})")

    def thinking(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the output starts inside the thinking (qwen3: unless `enable_thinking` is false)."""
        return self.name != "qwen3" or (template_kwargs or {}).get("enable_thinking", True) is not False

    def stream(self, thinking: bool) -> ReasoningStream:
        return ReasoningStream(thinking)

    def split(self, text: str, thinking: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a complete output; None where there is none (as vLLM's)."""
        if not thinking:
            return None, text
        stream = ReasoningStream(thinking)
        reasoning, content = stream.feed(text, final=True)
        return reasoning, content or None
