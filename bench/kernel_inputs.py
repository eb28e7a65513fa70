"""Random inputs for the Triton kernels, shared by `bench/bench_gpu.py` and the kernel tests (not shipped in any image).

Entries a kernel must never read (A/B rows beyond an adapter's rank, cache positions beyond a sequence's
length) can be filled with NaN ("poison"), so a kernel that reads them produces NaN instead of passing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lorafleet_worker.lora.weights import LoRAProjWeights
from torch import Tensor


def random_proj_weights(
    *,
    in_dim: int,
    widths: Sequence[int],
    ranks: Sequence[Sequence[int]],
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    poison: bool = True,
) -> LoRAProjWeights:
    """Stacked slot weights of one projection group: `ranks[slot][slice]` (0 = slice not adapted).

    Values are scaled so that a delta has roughly unit size; scalings are random in [0.5, 2).
    """
    gen = torch.Generator().manual_seed(seed)
    num_slots, n_slices = len(ranks), len(widths)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    a = torch.randn(num_slots, n_slices, max_rank, in_dim, generator=gen) / in_dim**0.5
    b = torch.randn(num_slots, offsets[-1], max_rank, generator=gen) / max_rank**0.5
    if poison:
        for slot, slot_ranks in enumerate(ranks):
            for s, r in enumerate(slot_ranks):
                a[slot, s, r:] = float("nan")
                b[slot, offsets[s] : offsets[s + 1], r:] = float("nan")
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    scalings = torch.rand(num_slots, n_slices, generator=gen) * 1.5 + 0.5
    return LoRAProjWeights(
        A=a.to(device, dtype),
        B=b.to(device, dtype),
        ranks=ranks_t.to(device),
        scalings=scalings.to(device),
        slice_offsets=tuple(offsets),
        ranks_cpu=ranks_t,
        scalings_cpu=scalings,
    )


@dataclass
class PagedKV:
    """One layer's paged K/V cache with block tables for a batch of decode sequences."""

    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor
    block_tables: Tensor  # int32 [B, max_blocks], padded with 0
    seq_lens: Tensor  # int32 [B]


def random_paged_kv(
    seq_lens: Sequence[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
    poison: bool = True,
) -> PagedKV:
    """Sequences scattered over shuffled blocks; with `poison`, every position outside a sequence is NaN."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq, default=1) or 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq, strict=True)):
        blocks = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        for j, blk in enumerate(blocks):
            valid[blk, : min(block_size, n - j * block_size)] = True
    if poison:
        k[~valid] = float("nan")
        v[~valid] = float("nan")
    return PagedKV(
        k_cache=k.to(device, dtype),
        v_cache=v.to(device, dtype),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32).to(device),
    )
