"""Tokenizer (Hugging Face `tokenizer.json` + chat template), incremental detokenization and stop strings."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

log = logging.getLogger(__name__)

# Prompt tokens kept as left context so that the first generated token decodes with its leading space.
_DETOKENIZE_CONTEXT = 5


class TokenizerError(ValueError):
    """The tokenizer files are missing or the chat template cannot be rendered."""


class NoChatTemplateError(TokenizerError):
    """The model has no chat template and none was given with --chat-template."""


def _token_content(value: Any) -> str | None:
    """`bos_token` / `eos_token` in tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _message_text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts (only text parts are supported)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise TokenizerError("only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise TokenizerError("message content must be a string or a list of text parts")


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: text content, and tool-call arguments as objects (OpenAI
    sends them as JSON strings; templates such as Qwen's and Llama's render them with `tojson`)."""
    out = {**message, "content": _message_text(message.get("content"))}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_template_tool_call(c) for c in calls]
    return out


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not (isinstance(function, Mapping) and isinstance(function.get("arguments"), str)):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"invalid chat template: {e}") from e


class Tokenizer:
    """A Hugging Face fast tokenizer read from a model directory, with its chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.has_chat_template = chat_template is not None
        self._template = None if chat_template is None else _compile_template(chat_template)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """The model's tokenizer; `chat_template` (Jinja source) replaces the model's own template."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found (the model directory needs a fast tokenizer)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise TokenizerError(f"{path}: cannot be read: {e}") from e
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = chat_template if chat_template is not None else _load_chat_template(model_dir, config)
        if template is None:
            log.info("%s has no chat template: chat requests are refused (give one with --chat-template)", model_dir)
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of `token_ids` (transformers' `convert_ids_to_tokens`)."""
        return [self._tok.id_to_token(i) or "" for i in token_ids]

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (used for logprobs)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: Iterable[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render OpenAI chat messages with the chat template; `template_kwargs` are extra template variables
        (as `chat_template_kwargs` in vLLM and `apply_chat_template(**kwargs)` in transformers); `tools` are
        the request's tools (OpenAI's shape), the template's `tools` variable."""
        if self._template is None:
            raise NoChatTemplateError(
                "this model has no chat template; use /v1/completions, or start the worker with --chat-template"
            )
        variables: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **(template_kwargs or {}),
            "tools": list(tools) if tools else None,
        }
        variables["messages"] = [_template_message(m) for m in messages]
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template error: {e}") from e

    def encode_chat(
        self,
        messages: Iterable[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a chat prompt (special tokens come from the template, as in transformers)."""
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs, tools=tools
        )
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas; never splits a multi-byte character.

    A few prompt tokens are kept as left context so that tokenizers which strip a leading space
    (SentencePiece) decode the first generated token as a continuation.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append a token; returns the text that became final."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where `text` must be cut for the stop string that completes first (None: no stop in it).

    Generation stops as soon as a stop string is complete (vLLM checks after every token), so
    the winner is the occurrence that ENDS first; of those ending together, the longest. This
    makes the result independent of how the text was streamed in chunks.
    """
    found = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


class StopStringMatcher:
    """Finds stop strings in streamed text; text that may begin a stop string is held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; returns what may be emitted now (the stop string itself is never emitted)."""
        if self.stopped:
            return ""
        self._pending += delta
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        start = first_stop(self._pending, self._stops)
        if start is not None:
            self.stopped = True
            out, self._pending = self._pending[:start], ""
            return out
        hold = self._held_suffix()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def skip(self, delta: str) -> str:
        """Emit `delta` without looking for stop strings in it (text of the first `min_tokens` tokens)."""
        if self.stopped:
            return ""
        out, self._pending = self._pending + delta, ""
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_suffix(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
