"""Batched token sampling over each sequence's sampling state.

Per row: the grammar mask of structured output (tokens the grammar forbids get -inf), then the
sequence's logits processors (logit_bias, min_tokens, penalties: logits_processors.py; greedy takes
the argmax here), then temperature, min_p, top-k and top-p, and a seeded or global draw. Logprobs
are those of the logits before the processors (vLLM's default `raw_logprobs`, taken as vLLM does after
the grammar mask), so they do not depend on the sampling fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lorafleet_worker.ops import cpu_attention
from lorafleet_worker.sample.logits_processors import LogitsProcessor, build_processors
from lorafleet_worker.sample.params import PromptLogprob, SampledToken, SamplingParams


@dataclass(eq=False)
class SamplingState:
    """One sequence's sampling: its params, seeded generator and logits processors.

    The scheduler advances it after each step (`accept` with the token the sequence sampled).
    """

    params: SamplingParams
    generator: torch.Generator | None = None
    processors: list[LogitsProcessor] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        *,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | None = None,
    ) -> SamplingState:
        generator = make_generator(params.seed, device or torch.device("cpu"))
        return cls(params, generator, build_processors(params, prompt_ids, eos_token_ids))

    def accept(self, token_id: int) -> None:
        for proc in self.processors:
            proc.accept(token_id)


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

    `allowed` ([N, V] bool, structured/manager.py): the tokens each row's grammar allows (all for a free row).
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
    logits = mask_logits(logits, allowed)
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
        probs = sampling_probs(logits[idx], [params[i] for i in rows])
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(rows):
            gen = generators[i]
            if gen is not None:
                noise[j].exponential_(generator=gen)
        tokens[idx] = (probs / noise).argmax(dim=-1)  # exponential race = multinomial draw
    return sampled_tokens(logprobs, tokens, params)


def mask_logits(logits: Tensor, allowed: Tensor | None) -> Tensor:
    """`logits` with the tokens the grammar forbids at -inf (`allowed` None: unchanged)."""
    return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))


def sampling_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The distribution each row draws from ([N, V]): temperature, then min_p, top-k and top-p (no greedy rows)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    scaled = logits / temps[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
        scaled = filter_min_p(scaled, min_p)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([max(p.top_k, 0) for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def sampled_tokens(logprobs: Tensor, tokens: Tensor, params: Sequence[SamplingParams]) -> list[SampledToken]:
    """Each row's token ([N]) with its log-probability under `logprobs` ([N, V]) and the top-k it asked for."""
    n = logprobs.shape[0]
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


def prompt_logprobs(logits: Tensor, targets: Sequence[int], k: int) -> list[PromptLogprob]:
    """Each target token scored under its row of `logits` ([N, V]): its logprob, its rank (vLLM's: the
    number of tokens with a logprob at least as high, itself included) and the row's top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = (logprobs >= chosen_t).sum(dim=-1).tolist()
    chosen = chosen_t[:, 0].tolist()
    if k:
        tv, ti = logprobs.topk(k, dim=-1)
        tops = [dict(zip(i, v, strict=True)) for i, v in zip(ti.tolist(), tv.tolist(), strict=True)]
    else:
        tops = [{} for _ in targets]
    return [PromptLogprob(lp, r, top) for lp, r, top in zip(chosen, ranks, tops, strict=True)]
