"""What passes between the scheduler and the model runner each step: the plan (`StepPlan`) and what the
forward pass and sampling gave back (`RunnerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet_worker.core.request import Sequence
from lorafleet_worker.sample.params import PromptLogprob, SampledToken


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    blocks: list[int] = field(default_factory=list)  # the sequence's KV block ids (the KV cache manager's list)
    # tokens proposed to follow the sequence, verified in this step (speculative decoding: after its last token)
    draft: list[int] = field(default_factory=list)
    forced: bool = False  # the draft is the grammar's only continuation (jump-forward): always accepted

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence (and its draft), so its last logits give the
        next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens) + len(self.draft)

    @property
    def input_ids(self) -> list[int]:
        """The tokens the chunk computes: the sequence's from `num_computed`, then its draft."""
        start = self.seq.num_computed
        tokens = self.seq.tokens[start : start + self.num_tokens]
        return tokens + self.draft if self.draft else tokens

    @property
    def generates(self) -> bool:
        """True when the chunk samples a token that the sequence keeps (not a prompt-only request)."""
        return self.samples and self.seq.params.max_tokens > 0

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token (empty unless asked, or done)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None:
            return range(0)
        start = max(seq.num_computed, len(seq.prompt_logprobs))  # a recomputed prompt is not scored twice
        return range(start, min(seq.num_computed + self.num_tokens, seq.num_prompt - 1))


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]  # single-token (decode) chunks first, then prefill chunks
    num_decode: int
    new_blocks: list[int] = field(default_factory=list)  # blocks handed out for this step: zeroed before it runs

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def slots(self) -> set[int]:
        return {c.seq.slot for c in self.chunks if c.seq.slot >= 0}


@dataclass
class RunnerOutput:
    """One step's results by request id: the sampled token of every chunk that generates without a draft,
    the tokens kept by every chunk that verified one (accepted draft tokens, then the token drawn after
    them), and the prompt logprobs scored in this step."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    verified: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
