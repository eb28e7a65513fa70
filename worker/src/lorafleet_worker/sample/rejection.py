"""Verifying draft tokens (speculative decoding, jump-forward) against the target model's logits.

A sequence with a draft of k tokens has k + 1 consecutive logits rows: row j scores the token after draft
token j - 1. Draft token j is accepted or rejected in order; at the first rejection the token drawn in its
place ends the step, and when all k are accepted the last row gives a bonus token. So each step yields
between 1 and k + 1 tokens.

Greedy rows accept a draft token when it is the row's argmax (the output is the same as without a draft).
Sampled rows use the rejection rule for a deterministic draft: token x is accepted with probability p(x)
(p: the row's sampling distribution after temperature, min_p, top-k and top-p), and on rejection the
replacement is drawn from p with x removed and renormalised, so every token keeps p's distribution.
Forced draft tokens (the grammar allows nothing else) are always accepted.
Log-probabilities are those `sample` reports (the grammar-masked raw logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lorafleet_worker.sample.params import SampledToken
from lorafleet_worker.sample.sampler import SamplingState, mask_logits, sample, sampled_tokens, sampling_probs


def verify(
    logits: Tensor,
    states: Sequence[SamplingState],
    drafts: Sequence[Sequence[int]],
    allowed: Tensor | None = None,
    *,
    forced: Sequence[bool] | None = None,
) -> list[list[SampledToken]]:
    """The tokens each sequence keeps: its accepted draft tokens, then the one drawn after them.

    `logits` ([sum(len(d) + 1), V]): the rows of each sequence in order; `states`, `drafts` (and `forced`:
    the draft is the grammar's only continuation) per sequence; `allowed`: the grammar masks of the rows.
    """
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    row_states = [st for st, d in zip(states, drafts, strict=True) for _ in range(len(d) + 1)]
    picks = sample(logits, row_states, allowed)  # each row's own draw: the bonus and greedy rows use it
    forced = forced or [False] * len(drafts)
    # the sampled sequences whose drafts the rejection rule decides, in one batch
    ruled = [i for i, d in enumerate(drafts) if d and not forced[i] and not states[i].params.greedy]
    chosen = _rejection_rule(logits, allowed, states, drafts, starts, ruled)
    for i, tokens in chosen.items():
        if tokens is None:  # every draft token accepted: the bonus token is the last row's draw
            chosen[i] = [*drafts[i], picks[starts[i + 1] - 1].token_id]
    out: list[list[SampledToken]] = []
    replaced: dict[tuple[int, int], int] = {}  # (sequence, row offset) -> token not drawn by `sample`
    for i, draft in enumerate(drafts):
        k, rows = len(draft), picks[starts[i] : starts[i + 1]]
        if forced[i]:
            tokens = [*draft, rows[k].token_id]
        elif i in chosen:
            tokens = chosen[i] or []
        else:  # greedy: the draft token is kept while it is the row's argmax
            a = next((j for j in range(k) if rows[j].token_id != draft[j]), k)
            tokens = [r.token_id for r in rows[: a + 1]]
        for j, t in enumerate(tokens):
            if t != rows[j].token_id:
                replaced[(i, j)] = t
        out.append(list(rows[: len(tokens)]))
    if replaced:  # their log-probabilities and top-k, as `sample` reports them
        keys = list(replaced)
        idx = torch.tensor([starts[i] + j for i, j in keys], device=logits.device)
        rows_allowed = None if allowed is None else allowed[idx]
        logprobs = torch.log_softmax(mask_logits(logits[idx], rows_allowed), dim=-1)
        ids = torch.tensor([replaced[key] for key in keys], device=logits.device)
        fixed = sampled_tokens(logprobs, ids, [states[i].params for i, _ in keys])
        for (i, j), tok in zip(keys, fixed, strict=True):
            out[i][j] = tok
    return out


def _rejection_rule(
    logits: Tensor,
    allowed: Tensor | None,
    states: Sequence[SamplingState],
    drafts: Sequence[Sequence[int]],
    starts: list[int],
    ruled: list[int],
) -> dict[int, list[int] | None]:
    """The tokens each sampled sequence of `ruled` keeps by the rejection rule: its accepted draft tokens and
    the token drawn in place of the first rejected one; None where every draft token was accepted."""
    if not ruled:
        return {}
    device = logits.device
    rows = [starts[i] + j for i in ruled for j in range(len(drafts[i]))]
    params = [states[i].params for i in ruled for _ in drafts[i]]
    idx = torch.tensor(rows, device=device)
    probs = sampling_probs(mask_logits(logits[idx], None if allowed is None else allowed[idx]), params)
    ids = torch.tensor([t for i in ruled for t in drafts[i]], device=device)
    p_draft = probs.gather(1, ids[:, None])[:, 0]
    u = torch.rand(len(rows), device=device)  # unseeded requests: the global generator
    at = 0
    for i in ruled:
        k, gen = len(drafts[i]), states[i].generator
        if gen is not None:
            u[at : at + k] = torch.rand(k, generator=gen, device=gen.device).to(device)
        at += k
    rejected = (u >= p_draft).tolist()
    chosen: dict[int, list[int] | None] = {}
    residual_rows: list[int] = []  # rows of `probs` where a draft token was rejected
    owners: list[int] = []  # their sequences
    at = 0
    for i in ruled:
        k = len(drafts[i])
        a = next((j for j in range(k) if rejected[at + j]), k)
        chosen[i] = list(drafts[i][:a]) if a < k else None
        if a < k:
            residual_rows.append(at + a)
            owners.append(i)
        at += k
    if residual_rows:  # draw from p with the rejected token removed, renormalised (an exponential race)
        r = torch.tensor(residual_rows, device=device)
        residual = probs[r].scatter(1, ids[r][:, None], 0.0)
        noise = torch.empty_like(residual).exponential_()
        for j, i in enumerate(owners):
            gen = states[i].generator
            if gen is not None:
                noise[j].exponential_(generator=gen)
        for i, t in zip(owners, (residual / noise).argmax(dim=-1).tolist(), strict=True):
            kept = chosen[i]
            assert kept is not None
            kept.append(t)
    return chosen
