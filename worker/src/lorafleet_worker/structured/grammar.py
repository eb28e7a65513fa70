"""Structured output's constraints and their compiler: each kind of constraint a request can give, llguidance
compiling it into a matcher template, with a cache.

Every kind implements `Constraint`: a JSON schema, any JSON object, a regex, a choice of strings, a Lark /
GBNF grammar and the tool-call constraints (`tool_choice: "required"` or a named function). Each says which
request field it came from and what llguidance grammar it is. `GrammarCompiler` builds llguidance's
tokenizer once from the model's `tokenizer.json` (no transformers) and compiles each constraint once (an
LRU cache keyed by the constraint). A constraint llguidance cannot compile, or a JSON-schema feature it
does not implement, raises `GrammarError` naming the field and, for a schema, the JSON pointer of the
offending keyword.

JSON is generated on one line in `json.dumps` style (`{"a": 1, "b": [2, 3]}`): whitespace is not
free, so a weak model cannot spend its tokens on blanks and every bounded schema has a bounded answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A grammar that cannot be used; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Constraint(Protocol):
    """What a request constrains its output to (hashable: the compiler's cache key)."""

    @property
    def param(self) -> str:
        """The request field it came from, for errors."""

    def grammar(self) -> str:
        """The llguidance grammar (raises GrammarError when there is none)."""

    def explain(self, error: str) -> str:
        """llguidance's compile error in the request's terms."""


@dataclass(frozen=True)
class _Text:
    """A constraint given as text; `param` is not part of its identity."""

    source: str
    param: str = field(compare=False)

    def explain(self, error: str) -> str:
        return f"{self.param}: {error.strip()}"


@dataclass(frozen=True)
class JsonSchema(_Text):
    """A JSON schema (`source`: its canonical JSON text)."""

    @classmethod
    def of(cls, schema: Any, param: str) -> JsonSchema:
        """From a schema object or its JSON text; GrammarError when it is not a JSON object."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{param}: not valid JSON: {e}", param) from None
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: a JSON schema must be an object", param)
        return cls(json.dumps(schema), param)  # key order kept: properties come in it

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS))

    def explain(self, error: str) -> str:
        pointer = _locate(json.loads(self.source), error.strip())
        where = f" (at {pointer})" if pointer else ""
        return f"{self.param}: unsupported or invalid JSON schema{where}: {error.strip()}"


@dataclass(frozen=True)
class ToolCalls(JsonSchema):
    """The calls `tool_choice` forces: an array of calls ("required") or one named function's arguments."""


@dataclass(frozen=True)
class JsonObject:
    """Any JSON object (`response_format: json_object`)."""

    param: str = field(compare=False)

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS))

    def explain(self, error: str) -> str:
        return f"{self.param}: {error.strip()}"


@dataclass(frozen=True)
class Regex(_Text):
    """A regular expression the whole output matches."""

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_regex(self.source))


@dataclass(frozen=True)
class Choice:
    """One of a list of strings."""

    options: tuple[str, ...]
    param: str = field(compare=False)

    @classmethod
    def of(cls, options: Sequence[str], param: str) -> Choice:
        if not options:
            raise GrammarError(f"{param}: give at least one choice", param)
        return cls(tuple(options), param)

    def grammar(self) -> str:
        return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in self.options)))

    def explain(self, error: str) -> str:
        return f"{self.param}: {error.strip()}"


@dataclass(frozen=True)
class Grammar(_Text):
    """A Lark grammar, or GBNF (llama.cpp / vLLM's EBNF) converted to Lark."""

    def grammar(self) -> str:
        try:
            return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.source)))
        except Exception as e:  # the converter raises plain exceptions
            raise GrammarError(f"{self.param}: {e}", self.param) from None


@dataclass
class CompilerStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0  # total time spent compiling (cache misses)


class CompiledGrammar:
    """A compiled constraint; `matcher()` gives each request its own state (a cheap copy)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._template = matcher

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer (thread-safe; compile off the event loop)."""

    def __init__(
        self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256
    ) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.stats = CompilerStats()
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: Path, *, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
        text = (Path(model_dir) / "tokenizer.json").read_text()
        return cls(text, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of `constraint` (from the cache when seen before); raises GrammarError."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                self.stats.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar())
        if matcher.is_error():
            raise GrammarError(constraint.explain(matcher.get_error()), constraint.param)
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - t0
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def _walk(node: Any, path: str = "#") -> Iterator[tuple[str, str, Any]]:
    """(pointer, key, value) of every member of every object in `node`, in document order."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
            yield here, str(key), value
            yield from _walk(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


def _locate(schema: Any, error: str) -> str:
    """The pointer of the first keyword the error names (`"uniqueItems"`) or whose value it quotes
    (`format: foo`, a regex `pattern`, a `$ref`); "" when none matches."""
    valued = {"format", "pattern", "$ref", "type"}
    for pointer, key, value in _walk(schema):
        if f'"{key}"' in error:
            return pointer
        if key in valued and isinstance(value, str) and value and value in error:
            return pointer
    return ""
