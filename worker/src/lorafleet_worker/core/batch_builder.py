"""Builds the model inputs of one step: a scheduler `StepPlan` turned into a `ForwardBatch` on the model's device."""

from __future__ import annotations

import torch
from torch import Tensor

from lorafleet_worker.core.kv_cache import block_table_tensor
from lorafleet_worker.core.step import StepPlan
from lorafleet_worker.model.forward_batch import ForwardBatch, PrefillSeq


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device) -> tuple[ForwardBatch, Tensor]:
    """The model inputs of a plan, and the per-token LoRA slots (int32 [T], -1 = base).

    Logits rows, chunk by chunk: the chunk's `prompt_logprob_positions`, then, if it samples, its last token
    and its draft tokens (speculative decoding verifies them all in this forward pass).
    Built from Python lists, one tensor each (a decode step of a few sequences is a few small lists: the torch
    ops a tensor-side build ran cost more than the lists).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []  # flat cache index of each token: its block's id * block_size + offset
    token_slots: list[int] = []
    starts: list[int] = []
    logits_rows: list[int] = []
    for c in plan.chunks:
        seq, n, start = c.seq, c.num_tokens, c.seq.num_computed
        blocks, span = c.blocks, range(start, start + n)
        starts.append(len(input_ids))
        input_ids.extend(c.input_ids)
        positions.extend(span)
        slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        token_slots.extend([seq.slot] * n)
        logits_rows.extend(starts[-1] + p - start for p in c.prompt_logprob_positions)
        if c.samples:  # the last token's row, after one row per draft token
            logits_rows.extend(range(len(input_ids) - 1 - len(c.draft), len(input_ids)))
    nd = plan.num_decode
    tables = block_table_tensor([c.blocks for c in plan.chunks], device)
    prefills = []
    for i in range(nd, len(plan.chunks)):
        c = plan.chunks[i]
        ctx = c.seq.num_computed + c.num_tokens
        prefills.append(PrefillSeq(starts[i], c.num_tokens, ctx, tables[i, : -(-ctx // block_size)].long()))
    decode_lens = [c.seq.num_computed + 1 for c in plan.chunks[:nd]]
    batch = ForwardBatch(
        input_ids=_tensor(input_ids, torch.int64, device),
        positions=_tensor(positions, torch.int64, device),
        slot_mapping=_tensor(slot_mapping, torch.int64, device),
        num_decode=nd,
        decode_block_tables=tables[:nd],
        decode_seq_lens=_tensor(decode_lens, torch.int32, device),
        prefills=prefills,
        logits_indices=_tensor(logits_rows, torch.int64, device),
    )
    return batch, torch.tensor(token_slots, dtype=torch.int32)


def _tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """`values` as a tensor on `device` (on the CPU, no `.to` call at all)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
