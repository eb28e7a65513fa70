"""What a request asks of sampling (`SamplingParams`) and what it gets back per token (`TokenOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0: prefill only (with prompt_logprobs: score the prompt)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature)
    seed: int | None = None
    logprobs: int | None = None  # None = none; k >= 0 = chosen token + top-k
    prompt_logprobs: int | None = None  # None = none; k >= 0 = each prompt token (after the first) + top-k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL / transformers: on prompt and generated tokens; 1 = off

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > max(self.max_tokens, 0):
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class PromptLogprob(NamedTuple):
    """One prompt token scored under the logits of the position before it (vLLM's `prompt_logprobs`)."""

    logprob: float
    rank: int  # 1 + the number of vocabulary tokens at least as likely, other than itself (vLLM's rank)
    top: dict[int, float]  # the row's top-k token ids and logprobs, most likely first


@dataclass
class TokenOutput:
    token_id: int
    logprob: float  # log-softmax of the (temperature-free) logits
    top_logprobs: dict[int, float] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    # on a request's first output when prompt_logprobs was asked: prompt tokens 1..n-1 scored
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None
