"""The model runner: owns the model, the KV block tensors, the LoRA backend and the step's grammar masks,
and runs one step: a scheduler plan in, each generating request's sampled token and the prompt logprobs out.

A step zeroes the KV blocks handed out for it, starts the grammar masks of the rows that sample (they are
filled in the structured-output manager's thread while the forward pass runs), builds the flat batch
(batch_builder.py), runs the forward pass with the step's LoRA context (a plain decode step as the replay of
a CUDA graph where those are on: cuda_graphs.py), scores prompt positions that asked for logprobs, and
samples under the masks.
"""

from __future__ import annotations

from torch import Tensor

from lorafleet_worker.core.batch_builder import build_forward_batch
from lorafleet_worker.core.cuda_graphs import DecodeGraphs
from lorafleet_worker.core.kv_cache import PagedKVCache
from lorafleet_worker.core.step import RunnerOutput, StepPlan
from lorafleet_worker.lora.backends import LoRABackend
from lorafleet_worker.lora.pool import LoRAPool
from lorafleet_worker.model import LoRAContext, Transformer
from lorafleet_worker.sample.rejection import verify
from lorafleet_worker.sample.sampler import prompt_logprobs, sample
from lorafleet_worker.structured.manager import StructuredOutputManager


class ModelRunner:
    """Runs the forward pass and sampling of one step on the model's device."""

    def __init__(
        self,
        model: Transformer,
        kv: PagedKVCache,
        structured: StructuredOutputManager,
        *,
        lora_backend: LoRABackend | None = None,
        lora_pool: LoRAPool | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.kv = kv
        self.structured = structured
        self.lora_backend = lora_backend
        self.lora_pool = lora_pool
        self.device = model.device
        self.sampler = sample  # a profiler may wrap it (bench/roofline.py times sampling this way)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.kv.zero(plan.new_blocks)
        generating = [c for c in plan.chunks if c.generates]
        masks = self.structured.start_masks([c.seq.request_id for c in generating], [c.draft for c in generating])
        batch, token_slots = build_forward_batch(plan, self.kv.block_size, self.device)
        output = RunnerOutput()
        if self.graphs is not None and self.graphs.fits(plan):
            logits = self.graphs.run(batch, token_slots)
        else:
            backend, pool = self.lora_backend, self.lora_pool
            if backend is not None and pool is not None and bool((token_slots >= 0).any()):
                info = backend.prepare(token_slots.to(self.device, non_blocking=True))
                batch.lora = LoRAContext(backend, pool, info)
            logits = self._score_prompts(plan, self.model(batch, self.kv), output)
        samplers = [c for c in plan.chunks if c.samples]
        if len(generating) < len(samplers):  # rows of requests with max_tokens=0 do not sample
            keep: list[int] = []
            row = 0
            for c in samplers:
                if c.generates:
                    keep.extend(range(row, row + 1 + len(c.draft)))
                row += 1 + len(c.draft)
            logits = logits[keep]
        allowed = masks.wait(logits.device)
        states = [c.seq.sampling for c in generating]
        if any(c.draft for c in generating):
            kept = verify(logits, states, [c.draft for c in generating], allowed, forced=[c.forced for c in generating])
            for c, tokens in zip(generating, kept, strict=True):
                if c.draft:
                    output.verified[c.seq.request_id] = tokens
                else:
                    output.sampled[c.seq.request_id] = tokens[0]
            return output
        picks = self.sampler(logits, states, allowed)
        output.sampled = {c.seq.request_id: pick for c, pick in zip(generating, picks, strict=True)}
        return output

    @staticmethod
    def _score_prompts(plan: StepPlan, logits: Tensor, output: RunnerOutput) -> Tensor:
        """Put the prompt logprobs of `logits`' scoring rows in `output`; return the rows that sample."""
        if not any(c.prompt_logprob_positions for c in plan.chunks):
            return logits
        row, sample_rows = 0, list[int]()
        for c in plan.chunks:
            positions = c.prompt_logprob_positions
            if positions:
                seq = c.seq
                targets = [seq.tokens[p + 1] for p in positions]
                k = seq.params.prompt_logprobs or 0
                scored = prompt_logprobs(logits[row : row + len(positions)], targets, k)
                output.prompt_logprobs[seq.request_id] = scored
                row += len(positions)
            if c.samples:
                sample_rows.extend(range(row, row + 1 + len(c.draft)))
                row += 1 + len(c.draft)
        return logits[sample_rows]
