"""One request's state inside the engine (`Sequence`): its tokens, sampling, adapter and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lorafleet_worker.sample.params import PromptLogprob, SamplingParams
from lorafleet_worker.sample.sampler import SamplingState
from lorafleet_worker.structured.grammar import CompiledGrammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: what it asked for, the tokens it has, and how far the engine got with it.

    Its KV blocks are the KV cache manager's (by `request_id`); its grammar's state is the structured-output
    manager's.
    """

    request_id: str
    tokens: list[int]  # prompt + generated tokens
    num_prompt: int
    params: SamplingParams
    max_len: int  # the sequence ends ("length") when len(tokens) reaches it
    sampling: SamplingState  # generator and logits processors
    adapter: str | None = None
    ref: Any = None  # AdapterRef pinning the adapter version, None for the base model
    grammar: CompiledGrammar | None = None  # structured output's constraint, compiled
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    slot_wait_since: float | None = None
    finish_reason: str | None = None
    # prompt tokens 1.. scored when params.prompt_logprobs is set (filled as the prompt is computed)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_len: int,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        adapter: str | None = None,
        ref: Any = None,
        grammar: CompiledGrammar | None = None,
        device: torch.device | None = None,
    ) -> Sequence:
        """A new request over `prompt_token_ids`, with its sampling state built from `params`."""
        return cls(
            request_id=request_id,
            tokens=list(prompt_token_ids),
            num_prompt=len(prompt_token_ids),
            params=params,
            max_len=max_len,
            sampling=SamplingState.create(params, prompt_token_ids, eos_token_ids=eos_token_ids, device=device),
            adapter=adapter,
            ref=ref,
            grammar=grammar,
        )

    @property
    def slot(self) -> int:
        """Its adapter's GPU LoRA slot while the request pins it, else -1 (read from the adapter manager's record)."""
        slot = self.ref.slot if self.ref is not None else None
        return -1 if slot is None else slot

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt
