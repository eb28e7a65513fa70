"""Paged KV cache storage: the K/V block tensors of every layer.

Layout per layer (read by the Triton paged-attention kernel too):
`k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`. A sequence owns a list
of block ids; token `p` of the sequence lives at `blocks[p // block_size]`, offset `p % block_size`.

The pool is allocated with `torch.empty` (no up-front fill of what may be many GiB). Attention masks the
positions of a block beyond a sequence's length, but a masked weight of 0 times a NaN left in uninitialised
memory is still NaN, so a block is zeroed before the first forward pass that uses it (the KV cache
manager reports the blocks it handed out), and block 0, which pads block tables, is zeroed at start.
What a sequence can read is then always finite: zeros or K/V it wrote. A block found again through the
prefix cache is not zeroed: it holds the K/V computed for exactly that prefix, tokens and adapter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lorafleet_worker.config import ModelConfig


class PagedKVCache:
    """The K/V block tensors of every layer (the model runner's; the KV cache manager hands out their ids)."""

    def __init__(
        self, config: ModelConfig, *, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self._k = torch.empty(shape, device=device, dtype=dtype)  # every layer's blocks, zeroed when handed out
        self._v = torch.empty(shape, device=device, dtype=dtype)
        self.k_caches = list(self._k.unbind(0))  # contiguous per-layer views
        self.v_caches = list(self._v.unbind(0))
        self.zero([0])  # block 0 pads block tables

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def zero(self, blocks: Sequence[int]) -> None:
        """Zero `blocks` of every layer (one op for K and one for V)."""
        if not blocks:
            return
        if len(blocks) == 1:
            self._k[:, blocks[0]].zero_()
            self._v[:, blocks[0]].zero_()
            return
        ids = torch.tensor(blocks, dtype=torch.int64).to(self._k.device, non_blocking=True)
        self._k.index_fill_(1, ids, 0)
        self._v.index_fill_(1, ids, 0)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.kv_size * elem


def block_table_tensor(tables: list[list[int]], device: torch.device) -> Tensor:
    """Pad block-id lists with 0 into an int32 `[len(tables), max_len]` tensor."""
    width = max((len(t) for t in tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
