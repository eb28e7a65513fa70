"""Grammars of structured output: request specs compiled by llguidance into matchers, with a cache.

A `GrammarSpec` says what a request asked for (a JSON schema, any JSON object, a regex, a choice
of strings, a Lark / GBNF grammar) and which request field it came from. `GrammarCompiler` builds
llguidance's tokenizer once from the model's `tokenizer.json` (no transformers), compiles each spec
once (an LRU cache keyed by the spec), and hands every sequence a fresh copy of the compiled matcher.
A spec llguidance cannot compile, or a JSON-schema feature it does not implement, raises
`GrammarError` naming the field and, for a schema, the JSON pointer of the offending keyword.

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
from typing import Any, Literal

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from lorafleet_worker.structured.masks import GrammarMatcher

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

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


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; `source` is canonical text (the cache key)."""

    kind: GrammarKind
    source: str
    param: str = field(compare=False)  # the request field it came from, for errors (not in the cache key)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{param}: not valid JSON: {e}", param) from None
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: a JSON schema must be an object", param)
        return cls("json_schema", json.dumps(schema), param)  # key order kept: properties come in it

    @classmethod
    def choice(cls, options: Sequence[str], param: str) -> GrammarSpec:
        if not options:
            raise GrammarError(f"{param}: give at least one choice", param)
        return cls("choice", json.dumps(list(options)), param)


@dataclass
class CompilerStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0  # total time spent compiling (cache misses)


class CompiledGrammar:
    """A compiled grammar; `matcher()` gives each sequence its own state (a cheap copy)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._template = matcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer (thread-safe; compile off the event loop)."""

    def __init__(
        self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256
    ) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.stats = CompilerStats()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: Path, *, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
        text = (Path(model_dir) / "tokenizer.json").read_text()
        return cls(text, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when seen before); raises GrammarError."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, _llguidance_grammar(spec))
        if matcher.is_error():
            raise GrammarError(_explain(spec, matcher.get_error()), spec.param)
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - t0
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def _llguidance_grammar(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        options = json.loads(spec.source)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    try:  # Lark, or GBNF (llama.cpp / vLLM's EBNF) converted to Lark
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.source))
    except Exception as e:  # the converter raises plain exceptions
        raise GrammarError(f"{spec.param}: {e}", spec.param) from None


def _explain(spec: GrammarSpec, error: str) -> str:
    """llguidance's error, with the JSON pointer of the schema keyword it is about."""
    error = error.strip()
    if spec.kind != "json_schema":
        return f"{spec.param}: {error}"
    pointer = _locate(json.loads(spec.source), error)
    where = f" (at {pointer})" if pointer else ""
    return f"{spec.param}: unsupported or invalid JSON schema{where}: {error}"


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
