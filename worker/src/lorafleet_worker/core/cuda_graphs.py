"""CUDA graphs for decode steps: the forward pass of a decode-only step is captured once per batch-size bucket
and then replayed, so that a step costs one graph launch instead of about 1,300 kernel launches from Python
(vLLM's CUDA graph capture, SGLang's `cuda_graph_runner.py`).

A graph reads static buffers that each step fills in place: the tokens, positions, KV slots, block tables,
context lengths and per-token LoRA slots (the gathered LoRA kernels read nothing else of a step). A step of n
sequences runs the smallest bucket of at least n; rows n.. of the bucket repeat row 0 (its token, position,
KV slot, blocks and adapter), so they write row 0's K/V values into row 0's slot once more, and their logits
are dropped. The block tables are as wide as `max_model_len` needs, so every context fits every graph.
Each bucket has two graphs, with and without the LoRA kernels, captured at the bucket's first step (a
warm-up pass first, which compiles the Triton kernels) into one shared memory pool.

Steps that are not plain decode (a prefill chunk, draft tokens to verify, prompt logprobs) or have more
sequences than the largest bucket run eagerly. The LoRA slot pool, the KV cache and the weights never move,
which is what lets a graph keep their addresses. CUDA with the Triton LoRA backend (or no LoRA) only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lorafleet_worker.lora.batch import gathered_batch_info
from lorafleet_worker.model.forward_batch import ForwardBatch, LoRAContext

if TYPE_CHECKING:
    from lorafleet_worker.core.kv_cache import PagedKVCache
    from lorafleet_worker.core.step import StepPlan
    from lorafleet_worker.lora.backends import LoRABackend
    from lorafleet_worker.lora.pool import LoRAPool
    from lorafleet_worker.model import Transformer

log = logging.getLogger(__name__)

# vLLM's default capture sizes up to 256 (1, 2, 4, then steps of 8, then of 16 and 32)
_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
MAX_BATCH = _SIZES[-1]  # the gathered LoRA layout serves decode-sized steps up to 256 tokens


def capture_sizes(max_bs: int) -> tuple[int, ...]:
    """The buckets for steps of up to `max_bs` sequences: the standard sizes below it, and `max_bs` itself."""
    if not 1 <= max_bs <= MAX_BATCH:
        raise ValueError(f"cuda_graph_max_bs must be between 1 and {MAX_BATCH}, got {max_bs}")
    return (*(s for s in _SIZES if s < max_bs), max_bs)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # the graph's output: float32 [bucket, vocab]


class DecodeGraphs:
    """The captured decode graphs of one model runner, and the static buffers they read."""

    def __init__(
        self,
        model: Transformer,
        kv: PagedKVCache,
        *,
        max_bs: int,
        max_model_len: int,
        lora_backend: LoRABackend | None = None,
        lora_pool: LoRAPool | None = None,
    ) -> None:
        self.model, self.kv = model, kv
        self.sizes = capture_sizes(max_bs)
        self.lora_backend, self.lora_pool = lora_backend, lora_pool
        device, n = model.device, self.sizes[-1]
        width = -(-max_model_len // kv.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._pool: Any = None  # the graphs' shared memory pool (a handle), after the first capture

    def fits(self, plan: StepPlan) -> bool:
        """Whether the plan is a plain decode step that a graph can run."""
        n = plan.num_decode
        if not 0 < n == len(plan.chunks) or n > self.sizes[-1]:
            return False
        return not any(c.draft or c.prompt_logprob_positions for c in plan.chunks)

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, batch: ForwardBatch, token_slots: Tensor) -> Tensor:
        """The logits of a decode step (`fits`), from the replay of its bucket's graph: float32 [n, vocab]."""
        n = batch.num_decode
        size = self.bucket(n)
        lora = self.lora_pool is not None and bool((token_slots >= 0).any())
        self.fill(batch, token_slots, size)
        entry = self._graphs.get((size, lora)) or self._capture(size, lora)
        entry.graph.replay()
        return entry.logits[:n]

    def fill(self, batch: ForwardBatch, token_slots: Tensor, size: int) -> None:
        """Copy a decode step of n <= size sequences into the static buffers; rows n..size repeat row 0."""
        n = batch.num_decode
        width = batch.decode_block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks is wider than max_model_len allows")
        pairs = (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.slot_mapping, batch.slot_mapping),
            (self.seq_lens, batch.decode_seq_lens),
            (self.token_slots, token_slots),
        )
        for static, value in pairs:
            static[:n].copy_(value, non_blocking=True)
            static[n:size].copy_(static[:1].expand(size - n))
        self.block_tables[:n, :width].copy_(batch.decode_block_tables, non_blocking=True)
        self.block_tables[n:size].copy_(self.block_tables[:1].expand(size - n, -1))

    def static_batch(self, size: int, lora: bool) -> ForwardBatch:
        """The forward batch of a bucket, over the static buffers (what a graph of that bucket reads)."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            num_decode=size,
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            prefills=[],
            logits_indices=self.logits_indices[:size],
        )
        if lora:
            assert self.lora_backend is not None and self.lora_pool is not None
            batch.lora = LoRAContext(self.lora_backend, self.lora_pool, gathered_batch_info(self.token_slots[:size]))
        return batch

    def _capture(self, size: int, lora: bool) -> _Graph:
        started = time.monotonic()
        batch = self.static_batch(size, lora)
        # warm-up on a side stream, as PyTorch's CUDA graph notes advise: compiles the Triton kernels, creates
        # what the step caches (cuBLAS workspaces, LoRA slice offsets) outside the capture
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            self.model(batch, self.kv)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        torch.cuda.synchronize(self.model.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (an adapter being copied into its slot) may use CUDA during a capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.model(batch, self.kv)
        self._pool = graph.pool()
        entry = self._graphs[(size, lora)] = _Graph(graph, logits)
        log.info(
            "captured the decode CUDA graph of %d sequences%s in %.1f s",
            size,
            " with LoRA" if lora else "",
            time.monotonic() - started,
        )
        return entry
