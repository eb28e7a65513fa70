"""What one forward step consumes: the flat token batch, its paged-cache metadata and its LoRA state.

The batch is ragged and flat: decode tokens of running sequences first (one token each), then prefill
chunks. `batch_builder.py` builds it from the scheduler's plan; the model only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk in the step: tokens [start, start+num_tokens) of the flat batch."""

    start: int  # offset of the chunk in the flat token batch
    num_tokens: int
    context_len: int  # tokens in the cache after this step (prior context + chunk)
    block_ids: Tensor  # int64 [ceil(context_len / block_size)] on the model's device
    mask: Tensor | None = None  # bool [num_tokens, context_len]; None = plain causal (no prior context, no window)


@dataclass
class ForwardBatch:
    """Everything one forward step needs; `batch_builder.py` builds it from the scheduler's plan."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    slot_mapping: Tensor  # int64 [T], flat cache index block * block_size + offset
    num_decode: int  # the first num_decode tokens are single decode tokens of num_decode sequences
    decode_block_tables: Tensor  # int32 [num_decode, max_blocks] (padded with 0)
    decode_seq_lens: Tensor  # int32 [num_decode], context length including the new token
    prefills: list[PrefillSeq]
    logits_indices: Tensor  # int64 [N], rows of the flat batch whose logits are returned
    lora: LoRAContext | None = None
    decode_mask: Tensor | None = None  # bool [num_decode, 1, 1, max_blocks * block_size] (torch attention)
    # every row as one query over its own context (the "cpu" backend): int32 [T, max_blocks] and [T]
    row_block_tables: Tensor | None = None
    row_seq_lens: Tensor | None = None

    def prepare_masks(self, block_size: int, window: int | None, decode: bool = True, rows: bool = False) -> None:
        """Build the attention masks of the torch path once per step (shared by every layer).

        `window`: sliding-window size (a query at position p sees keys p - window < k <= p), None = full.
        `decode`: also the decode mask (only the torch decode backend reads it).
        `rows`: instead of the prefill masks, a block table and a context length for every row of the step
        (`row_block_tables`), for the "cpu" backend, whose paged kernel then serves prefill rows as it serves
        decode rows: a prompt token at position p is a query over the cached tokens 0..p.
        """
        if rows:
            self._prepare_rows()
            return
        device = self.positions.device
        if self.num_decode and decode:
            keys = torch.arange(self.decode_block_tables.shape[1] * block_size, device=device)[None, :]
            lens = self.decode_seq_lens[:, None]
            mask = keys < lens
            if window is not None:
                mask &= keys >= lens - window
            self.decode_mask = mask[:, None, None, :]
        for p in self.prefills:
            prior = p.context_len - p.num_tokens
            if prior or (window is not None and p.context_len > window):
                qpos = torch.arange(prior, p.context_len, device=device)[:, None]
                keys = torch.arange(p.context_len, device=device)[None, :]
                p.mask = keys <= qpos
                if window is not None:
                    p.mask &= keys > qpos - window

    def query_tables(self) -> tuple[Tensor, Tensor]:
        """The block table and context length of each row as a paged-kernel query: every row's after
        `prepare_masks` with `rows`, else the decode rows' (a decode-only step)."""
        if self.row_block_tables is not None and self.row_seq_lens is not None:
            return self.row_block_tables, self.row_seq_lens
        return self.decode_block_tables, self.decode_seq_lens

    def _prepare_rows(self) -> None:
        tables = [self.decode_block_tables[: self.num_decode]]
        lens = [self.decode_seq_lens[: self.num_decode]]
        for p in self.prefills:
            tables.append(p.block_ids.to(torch.int32).expand(p.num_tokens, -1))
            lens.append(torch.arange(p.context_len - p.num_tokens + 1, p.context_len + 1, dtype=torch.int32))
        width = max(t.shape[1] for t in tables)
        self.row_block_tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
        self.row_seq_lens = torch.cat(lens).to(self.positions.device)


@dataclass
class LoRAContext:
    """The step's LoRA state: backend (torch / triton), slot pool and per-step batch info."""

    backend: Any  # lora.backends.LoRABackend
    pool: Any  # lora.pool.LoRAPool, pool.weights(layer, group) -> LoRAProjWeights
    batch: Any  # lora.batch.LoRABatchInfo
    run: Any = field(init=False, default=None)  # the backend's fast path for this step (`step_runner`), or None

    def __post_init__(self) -> None:
        self.run = self.backend.step_runner(self.pool, self.batch)

    def apply(self, layer: int, group: str, x: Tensor, out: Tensor) -> None:
        if self.run is not None:
            self.run(layer, group, x, out)
        else:
            self.backend.apply(x, out, self.pool.weights(layer, group), self.batch)
