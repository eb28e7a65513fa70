"""`--speculative-config`: vLLM's speculative-decoding settings, the n-gram (prompt lookup) method only."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

# on CPU a verify step of k+1 tokens a sequence costs far more than a decode token once the batch is no longer
# memory-bound: speculation pays only for a few running requests
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `SpeculativeConfig` keys for `method: "ngram"`.

    `num_speculative_tokens`: the most draft tokens proposed a step; `prompt_lookup_min` / `prompt_lookup_max`:
    the n-gram sizes looked up (one given: the other is the same; none: both 5, as in vLLM);
    `disable_by_batch_size`: a step proposes no drafts while more requests than this are running.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From `--speculative-config` JSON; ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"--speculative-config: unknown field {key!r} (known: {', '.join(sorted(known))})")
            want = str if key == "method" else int
            if value is not None and (not isinstance(value, want) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config: {key} must be {'a string' if want is str else 'an integer'}")
        raw = {k: v for k, v in raw.items() if v is not None}
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is not None:
            raw["prompt_lookup_min"] = hi
        if hi is None and lo is not None:
            raw["prompt_lookup_max"] = lo
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"--speculative-config: method {self.method!r} is not supported (only 'ngram')")
        if self.num_speculative_tokens < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be at least 1")
