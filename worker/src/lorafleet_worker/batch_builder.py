"""The model inputs of one step: a scheduler `StepPlan` turned into a `ForwardBatch` on the model's device."""

from __future__ import annotations

import torch
from torch import Tensor

from lorafleet_worker.kv_cache import block_table_tensor
from lorafleet_worker.model.forward_batch import ForwardBatch, PrefillSeq
from lorafleet_worker.scheduler import StepPlan


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device) -> tuple[ForwardBatch, Tensor]:
    """The model inputs of a plan, and the per-token LoRA slots (int32 [T], -1 = base).

    Logits rows, chunk by chunk: the chunk's `prompt_logprob_positions`, then its last token if it samples.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    seq_idx: list[int] = []
    token_slots: list[int] = []
    starts: list[int] = []
    logits_rows: list[int] = []
    for i, c in enumerate(plan.chunks):
        seq, n, start = c.seq, c.num_tokens, c.seq.num_computed
        starts.append(len(input_ids))
        input_ids.extend(seq.tokens[start : start + n])
        positions.extend(range(start, start + n))
        seq_idx.extend([i] * n)
        token_slots.extend([seq.slot] * n)
        logits_rows.extend(starts[-1] + p - start for p in c.prompt_logprob_positions)
        if c.samples:
            logits_rows.append(len(input_ids) - 1)
    tables = block_table_tensor([c.seq.blocks for c in plan.chunks], torch.device("cpu")).long()
    pos = torch.tensor(positions, dtype=torch.int64)
    slot_mapping = tables[torch.tensor(seq_idx), pos // block_size] * block_size + pos % block_size

    nd = plan.num_decode
    dev_tables = tables.to(device, torch.int32, non_blocking=True)
    prefills = []
    for i in range(nd, len(plan.chunks)):
        c = plan.chunks[i]
        ctx = c.seq.num_computed + c.num_tokens
        prefills.append(PrefillSeq(starts[i], c.num_tokens, ctx, dev_tables[i, : -(-ctx // block_size)].long()))
    decode_lens = [c.seq.num_computed + 1 for c in plan.chunks[:nd]]
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=pos.to(device, non_blocking=True),
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        num_decode=nd,
        decode_block_tables=dev_tables[:nd],
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32).to(device, non_blocking=True),
        prefills=prefills,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(device, non_blocking=True),
    )
    return batch, torch.tensor(token_slots, dtype=torch.int32)
