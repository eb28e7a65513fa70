"""Paged KV cache: per-layer block tensors plus a block allocator.

Layout per layer (read by the Triton paged-attention kernel too):
`k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`. A sequence owns a list
of block ids; token `p` of the sequence lives at `blocks[p // block_size]`, offset `p % block_size`.

The pool is allocated with `torch.empty` (no up-front fill of what may be many GiB). Attention masks the
positions of a block beyond a sequence's length, but a masked weight of 0 times a NaN left in uninitialised
memory is still NaN, so a block is zeroed when it is handed out (`grow`), and block 0, which pads block
tables, is zeroed at start. What a sequence can read is then always finite: zeros or K/V it wrote.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafleet_worker.config import ModelConfig


class BlockAllocator:
    """Free-list of block ids; allocation is all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` block ids, or None (nothing allocated) if fewer than `n` are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._used[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._used[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._used[b] = 0
            self._free.append(b)


class PagedKVCache:
    """K/V block tensors of every layer and the allocator that hands out their blocks."""

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
        self.allocator = BlockAllocator(num_blocks)
        self._zero([0])  # block 0 pads block tables

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _zero(self, blocks: list[int]) -> None:
        """Zero `blocks` of every layer (one op for K and one for V)."""
        if len(blocks) == 1:
            self._k[:, blocks[0]].zero_()
            self._v[:, blocks[0]].zero_()
            return
        ids = torch.tensor(blocks, dtype=torch.int64).to(self._k.device, non_blocking=True)
        self._k.index_fill_(1, ids, 0)
        self._v.index_fill_(1, ids, 0)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` in place so that it holds `num_tokens` tokens; False (unchanged) if out of blocks."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need <= 0:
            return True
        new = self.allocator.allocate(need)
        if new is None:
            return False
        self._zero(new)
        blocks.extend(new)
        return True

    def release(self, blocks: list[int]) -> None:
        """Return every block of `blocks` to the allocator and empty the list."""
        self.allocator.free(blocks)
        blocks.clear()

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.kv_size * elem


def block_table_tensor(tables: list[list[int]], device: torch.device) -> Tensor:
    """Pad block-id lists with 0 into an int32 `[len(tables), max_len]` tensor."""
    width = max((len(t) for t in tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
