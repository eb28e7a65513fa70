"""Sampling parameters, each sequence's sampling state, and batched token sampling.

Per row: the grammar mask of structured output (tokens the grammar forbids get -inf), then the
sequence's logits processors (logit_bias, min_tokens, penalties: logits_processors.py; greedy takes
the argmax here), then temperature, min_p, top-k and top-p, and a seeded or global draw. Logprobs
are those of the logits before the processors (vLLM's default `raw_logprobs`, taken as vLLM does after
the grammar mask), so they do not depend on the sampling fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lorafleet_worker.model import cpu_attention
from lorafleet_worker.sample.logits_processors import LogitsProcessor, build_processors

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


@dataclass
class TokenOutput:
    token_id: int
    logprob: float  # log-softmax of the (temperature-free) logits
    top_logprobs: dict[int, float] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    # on a request's first output when prompt_logprobs was asked: (logprob, top-k) of prompt tokens 1..n-1
    prompt_logprobs: list[tuple[float, dict[int, float]]] | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


class TokenConstraint(Protocol):
    """A grammar that a sequence's output must follow (structured/masks.py computes its masks)."""

    @property
    def finished(self) -> bool:
        """True once the grammar admits no more tokens (the sequence ends with "stop")."""

    def accept(self, token_id: int) -> None:
        """Advance over the sampled token."""


@dataclass(eq=False)
class SamplingState:
    """One sequence's sampling: its params, seeded generator, logits processors and grammar.

    Advanced in one place: the engine calls `accept` with each token the sequence samples.
    """

    params: SamplingParams
    generator: torch.Generator | None = None
    processors: list[LogitsProcessor] = field(default_factory=list)
    constraint: TokenConstraint | None = None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        *,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | None = None,
        constraint: TokenConstraint | None = None,
    ) -> SamplingState:
        generator = make_generator(params.seed, device or torch.device("cpu"))
        return cls(params, generator, build_processors(params, prompt_ids, eos_token_ids), constraint)

    def accept(self, token_id: int) -> None:
        for proc in self.processors:
            proc.accept(token_id)
        if self.constraint is not None:
            self.constraint.accept(token_id)

    @property
    def finished(self) -> bool:
        """True when the grammar is complete: nothing but EOS could follow."""
        return self.constraint is not None and self.constraint.finished


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator for seeded sampling (None: use the global RNG)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) logits outside each row's top-k and nucleus top-p; `top_k` 0 = off, `top_p` 1 = off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    sorted_logits = sorted_logits.masked_fill((before > top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def process_logits(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """Logits after each row's processors (a copy when any applies)."""
    rows = [i for i, st in enumerate(states) if st.processors]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        for proc in states[i].processors:
            proc.apply(logits[i])
    return logits


def filter_min_p(scaled: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is below `min_p` x the row's top probability (0 = off)."""
    probs = scaled.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def sample(logits: Tensor, states: Sequence[SamplingState], allowed: Tensor | None = None) -> list[SampledToken]:
    """Pick one token per row of `logits` ([N, V], float32) for the matching sequence's sampling state.

    `allowed` ([N, V] bool, structured/masks.py): the tokens each row's grammar allows (all for a free row).
    """
    n = logits.shape[0]
    if n == 0:
        return []
    device = logits.device
    params = [st.params for st in states]
    if allowed is None:
        picked = _plain_greedy(logits, states)
        if picked is not None:
            return picked
    generators = [st.generator for st in states]
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    processed = process_logits(logits, states)
    if allowed is not None and processed is not logits:
        # a processor that forbids all the grammar allows (min_tokens masking the EOS of a finished
        # grammar): the grammar wins
        dead = torch.isneginf(processed).all(dim=-1)
        if bool(dead.any()):
            processed[dead] = logits[dead]
    logits = processed
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=device)
        temps = torch.tensor([params[i].temperature for i in rows], device=device, dtype=logits.dtype)
        scaled = logits[idx] / temps[:, None]
        if any(params[i].min_p > 0 for i in rows):
            min_p = torch.tensor([params[i].min_p for i in rows], device=device, dtype=logits.dtype)
            scaled = filter_min_p(scaled, min_p)
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows):
            top_k = torch.tensor([max(params[i].top_k, 0) for i in rows], device=device)
            top_p = torch.tensor([params[i].top_p for i in rows], device=device, dtype=logits.dtype)
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(rows):
            gen = generators[i]
            if gen is not None:
                noise[j].exponential_(generator=gen)
        tokens[idx] = (probs / noise).argmax(dim=-1)  # exponential race = multinomial draw
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max((p.logprobs or 0 for p in params), default=0)
    top_v: list[list[float]] = [[] for _ in range(n)]
    top_i: list[list[int]] = [[] for _ in range(n)]
    if k:
        tv, ti = logprobs.topk(k, dim=-1)
        top_v, top_i = tv.tolist(), ti.tolist()
    token_list, chosen_list = tokens.tolist(), chosen.tolist()
    out = []
    for r, p in enumerate(params):
        top = None
        if p.logprobs is not None:
            top = dict(zip(top_i[r][: p.logprobs], top_v[r][: p.logprobs], strict=True))
        out.append(SampledToken(token_list[r], chosen_list[r], top))
    return out


def _plain_greedy(logits: Tensor, states: Sequence[SamplingState]) -> list[SampledToken] | None:
    """Greedy rows with no processors and no logprobs asked for, on CPU: the C++ pick (argmax and the chosen
    log-probability in two passes a row, `cpu_attention.greedy_pick`), the same tokens and log-probabilities
    as the general path below within float rounding. None: the general path serves this batch."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    if any(not st.params.greedy or st.params.logprobs is not None or st.processors for st in states):
        return None
    if not cpu_attention.available():
        return None
    picked = cpu_attention.greedy_pick(logits)
    if picked is None:  # a NaN or an infinity in some row: torch's IEEE results
        return None
    tokens, logprobs = picked
    return [SampledToken(t, lp, None) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]


def prompt_logprobs(logits: Tensor, targets: Sequence[int], k: int) -> list[tuple[float, dict[int, float]]]:
    """Logprob of each target token under its row of `logits` ([N, V]) and the row's top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0].tolist()
    if k:
        tv, ti = logprobs.topk(k, dim=-1)
        tops = [dict(zip(i, v, strict=True)) for i, v in zip(ti.tolist(), tv.tolist(), strict=True)]
    else:
        tops = [{} for _ in targets]
    return list(zip(chosen, tops, strict=True))
