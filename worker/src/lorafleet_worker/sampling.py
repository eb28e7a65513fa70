"""Sampling parameters and batched token sampling (greedy, temperature, top-k, top-p, seeds, logprobs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    seed: int | None = None
    logprobs: int | None = None  # None = none; k >= 0 = chosen token + top-k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
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


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


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


def sample(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[SampledToken]:
    """Pick one token per row of `logits` ([N, V], float32) for the matching params/generator."""
    n = logits.shape[0]
    if n == 0:
        return []
    device = logits.device
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=device)
        temps = torch.tensor([params[i].temperature for i in rows], device=device, dtype=logits.dtype)
        scaled = logits[idx] / temps[:, None]
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
