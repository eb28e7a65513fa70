"""Per-sequence logits processors: logit_bias, min_tokens and the penalties.

Each sequence carries its own processors (built once by `build_processors`); the scheduler calls
`accept` with every token it samples, and `apply` changes one row of logits in place before the
sampler draws. vLLM's order: logit_bias, min_tokens, then the repetition / frequency / presence
penalties. The grammar of structured output is not here: its masks are computed for the whole batch
off the critical path (structured/manager.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from lorafleet_worker.sample.params import SamplingParams


class LogitsProcessor(Protocol):
    """Changes one sequence's logits; keeps whatever state it needs from the tokens it is shown."""

    def apply(self, row: Tensor) -> None:
        """Change `row` ([V] logits of the next token) in place."""

    def accept(self, token_id: int) -> None:
        """The token the sequence sampled this step."""


class LogitBias:
    """OpenAI's logit_bias: a value added to the logits of listed tokens."""

    def __init__(self, bias: dict[int, float]) -> None:
        self._ids = list(bias)
        self._values = list(bias.values())

    def apply(self, row: Tensor) -> None:
        row[self._ids] += torch.tensor(self._values, device=row.device, dtype=row.dtype)

    def accept(self, token_id: int) -> None:
        pass


class MinTokens:
    """EOS and stop_token_ids are masked until `min_tokens` tokens were generated."""

    def __init__(self, min_tokens: int, stop_ids: Iterable[int]) -> None:
        self._left = min_tokens
        self._stops = sorted(set(stop_ids))

    def apply(self, row: Tensor) -> None:
        if self._left > 0:
            row[[t for t in self._stops if 0 <= t < row.shape[0]]] = float("-inf")

    def accept(self, token_id: int) -> None:
        self._left -= 1


class RepetitionPenalty:
    """CTRL / transformers: logits of every token seen in the prompt or output are divided (positive) or
    multiplied (negative) by the penalty."""

    def __init__(self, penalty: float, prompt_ids: Sequence[int]) -> None:
        self._penalty = penalty
        self._seen = set(prompt_ids)
        self._index: Tensor | None = None

    def apply(self, row: Tensor) -> None:
        if not self._seen:
            return
        if self._index is None or self._index.device != row.device:
            self._index = torch.tensor(sorted(self._seen), device=row.device)
        vals = row[self._index]
        row[self._index] = torch.where(vals > 0, vals / self._penalty, vals * self._penalty)

    def accept(self, token_id: int) -> None:
        if token_id not in self._seen:
            self._seen.add(token_id)
            self._index = None


class OccurrencePenalties:
    """OpenAI's frequency (per occurrence) and presence (once) penalties over the generated tokens."""

    def __init__(self, frequency: float, presence: float) -> None:
        self._frequency = frequency
        self._presence = presence
        self._counts: Counter[int] = Counter()

    def apply(self, row: Tensor) -> None:
        if not self._counts:
            return
        ids = torch.tensor(list(self._counts), device=row.device)
        counts = torch.tensor(list(self._counts.values()), device=row.device, dtype=row.dtype)
        row[ids] -= self._frequency * counts + self._presence

    def accept(self, token_id: int) -> None:
        self._counts[token_id] += 1


def build_processors(
    params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Iterable[int]
) -> list[LogitsProcessor]:
    """The processors `params` asks for, in vLLM's order (none for plain sampling)."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        out.append(LogitBias(params.logit_bias))
    if params.min_tokens:
        stops = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        out.append(MinTokens(params.min_tokens, stops))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(params.repetition_penalty, prompt_ids))
    if params.frequency_penalty or params.presence_penalty:
        out.append(OccurrencePenalties(params.frequency_penalty, params.presence_penalty))
    return out
